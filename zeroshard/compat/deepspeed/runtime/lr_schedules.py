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
# the parameter names, under DeepSpeed's constants (its tests and some clients build scheduler.params with them)
LR_RANGE_TEST_MIN_LR = "lr_range_test_min_lr"
LR_RANGE_TEST_STEP_RATE = "lr_range_test_step_rate"
LR_RANGE_TEST_STEP_SIZE = "lr_range_test_step_size"
LR_RANGE_TEST_STAIRCASE = "lr_range_test_staircase"
EDGE_VALUE, MID_VALUE = "edge_value", "mid_value"
CYCLE_FIRST_STEP_SIZE = "cycle_first_step_size"
CYCLE_FIRST_STAIR_COUNT = "cycle_first_stair_count"
CYCLE_SECOND_STEP_SIZE = "cycle_second_step_size"
CYCLE_SECOND_STAIR_COUNT = "cycle_second_stair_count"
DECAY_STEP_SIZE = "decay_step_size"
CYCLE_MIN_LR, CYCLE_MAX_LR, DECAY_LR_RATE = "cycle_min_lr", "cycle_max_lr", "decay_lr_rate"
CYCLE_MIN_MOM, CYCLE_MAX_MOM, DECAY_MOM_RATE = "cycle_min_mom", "cycle_max_mom", "decay_mom_rate"
WARMUP_MIN_LR, WARMUP_MAX_LR, WARMUP_NUM_STEPS = "warmup_min_lr", "warmup_max_lr", "warmup_num_steps"
WARMUP_TYPE, WARMUP_LOG_RATE, WARMUP_LINEAR_RATE = "warmup_type", "log", "linear"
WARMUP_MIN_RATIO, COS_MIN_RATIO = "warmup_min_ratio", "cos_min_ratio"
TOTAL_NUM_STEPS = "total_num_steps"


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
