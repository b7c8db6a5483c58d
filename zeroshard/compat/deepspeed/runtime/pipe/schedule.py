"""``deepspeed.runtime.pipe.schedule``: DeepSpeed's pipeline instructions and schedules are zeroshard's
(``zeroshard.pipe.instructions``, ``zeroshard.pipe.schedule``), the same classes: a client's patch of
``TrainSchedule.steps`` or its ``_INSTRUCTION_MAP`` entry keyed by ``ReduceGrads`` changes what the engine runs."""

from .....pipe import instructions
from .....pipe.dualpipev import DualPipeVSchedule
from .....pipe.instructions import *  # noqa: F403 - DeepSpeed's instruction classes, the same objects
from .....pipe.schedule import DataParallelSchedule, InferenceSchedule, PipeSchedule, TrainSchedule


def _is_even(x: int) -> bool:
    """DeepSpeed's helper (its clients' schedules import it)."""
    return x % 2 == 0


def _is_odd(x: int) -> bool:
    return x % 2 != 0


__all__ = [
    *(name for name in instructions.__all__ if name != "BATCH_END"),
    "DataParallelSchedule",
    "DualPipeVSchedule",
    "InferenceSchedule",
    "PipeSchedule",
    "TrainSchedule",
    "_is_even",
    "_is_odd",
]
