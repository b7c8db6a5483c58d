"""``deepspeed.runtime.data_pipeline``: DeepSpeed's data efficiency library, imported by clients at module top
(gpt-neox) but not built here."""

from . import curriculum_scheduler

__all__ = ["curriculum_scheduler"]
