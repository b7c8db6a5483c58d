"""``deepspeed.runtime.lr_schedules``: the schedules by DeepSpeed's names, built by zeroshard's schedule runner.

``WarmupLR(optimizer, **params)`` and the others take the parameters of the config's ``scheduler.params``."""

from __future__ import annotations

from zeroshard.optim.schedules import SCHEDULES, ScheduleRunner, build_schedule

VALID_LR_SCHEDULES = sorted(SCHEDULES)
LR_SCHEDULE = "lr_schedule"
LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR = (
    "LRRangeTest",
    "OneCycle",
    "WarmupLR",
    "WarmupDecayLR",
    "WarmupCosineLR",
)


def _schedule(name: str):
    def build(optimizer, **params) -> ScheduleRunner:
        return build_schedule(name, params, optimizer)

    build.__name__ = build.__qualname__ = name
    build.__doc__ = f"The ``{name}`` schedule over ``optimizer`` (keyword arguments as in ``scheduler.params``)."
    return build


WarmupLR = _schedule(WARMUP_LR)
WarmupDecayLR = _schedule(WARMUP_DECAY_LR)
WarmupCosineLR = _schedule(WARMUP_COSINE_LR)
OneCycle = _schedule(ONE_CYCLE)
LRRangeTest = _schedule(LR_RANGE_TEST)

__all__ = [
    "LRRangeTest",
    "OneCycle",
    "VALID_LR_SCHEDULES",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
]
