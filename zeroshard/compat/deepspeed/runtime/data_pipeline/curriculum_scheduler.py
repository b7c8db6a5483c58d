"""``deepspeed.runtime.data_pipeline.curriculum_scheduler``: importable (gpt-neox imports it at module top); building
a scheduler is refused by name."""

from ..._not_built import not_built

CurriculumScheduler = not_built(
    "deepspeed.runtime.data_pipeline.curriculum_scheduler.CurriculumScheduler",
    "curriculum learning (a schedule of sequence lengths or difficulties over training) is not built; the "
    "'curriculum_learning' and 'data_efficiency' config blocks are refused, and a script can shorten its own batches",
)

__all__ = ["CurriculumScheduler"]
