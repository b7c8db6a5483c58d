"""``deepspeed.runtime.lr_schedules``: the schedules by DeepSpeed's names, built by zeroshard's schedule runner.

``WarmupLR(optimizer, **params)`` and the others take the parameters of the config's ``scheduler.params`` and answer
the attributes DeepSpeed's schedule objects expose (``min_lrs``, ``max_lrs``, ``warmup_num_steps``, ``step_ratio``,
``get_lr_ratio()``, ...), read from zeroshard's resolved parameters."""

from __future__ import annotations

import torch

from zeroshard.optim.schedules import SCHEDULES, ScheduleRunner, schedule_parts, warmup_cosine_ratio

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


def get_torch_optimizer(optimizer):
    """The ``torch.optim.Optimizer`` a schedule drives: ``optimizer``, or the one a wrapper holds."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        return optimizer.optimizer
    raise TypeError(f"{type(optimizer).__name__} is not a subclass of torch.optim.Optimizer")


class _Schedule(ScheduleRunner):
    """One of DeepSpeed's schedule classes: zeroshard's runner built from the same keyword arguments (those of
    ``scheduler.params``), with the attributes DeepSpeed's schedules expose, read from the resolved parameters."""

    NAME = ""

    def __init__(self, optimizer, last_batch_iteration: int = -1, **params):
        optimizer = get_torch_optimizer(optimizer)
        self.org_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        super().__init__(optimizer, *schedule_parts(self.NAME, params, optimizer))
        self.last_batch_iteration = last_batch_iteration  # DeepSpeed sets lrs at construction only from -1

    def _setting(self, key: str) -> list:
        """``key`` per parameter group (the resolved parameters hold every default)."""
        return [group[key] for group in self.params]


class _Warmup(_Schedule):
    @property
    def warmup_num_steps(self) -> int:
        return max(2, self._setting(WARMUP_NUM_STEPS)[0])

    @property
    def warmup_type(self) -> str:
        return self._setting(WARMUP_TYPE)[0]


class WarmupLR(_Warmup):
    """``deepspeed.runtime.lr_schedules.WarmupLR``."""

    NAME = WARMUP_LR

    @property
    def min_lrs(self) -> list:
        return self._setting(WARMUP_MIN_LR)

    @property
    def max_lrs(self) -> list:
        return [base if top is None else top for base, top in zip(self.org_lrs, self._setting(WARMUP_MAX_LR))]


class WarmupDecayLR(WarmupLR):
    """``deepspeed.runtime.lr_schedules.WarmupDecayLR``."""

    NAME = WARMUP_DECAY_LR

    @property
    def total_num_steps(self) -> int:
        return self._setting(TOTAL_NUM_STEPS)[0]


class WarmupCosineLR(_Warmup):
    """``deepspeed.runtime.lr_schedules.WarmupCosineLR``."""

    NAME = WARMUP_COSINE_LR

    @property
    def total_num_steps(self) -> int:
        return self._setting(TOTAL_NUM_STEPS)[0]

    def get_lr_ratio(self) -> float:
        """The factor of each group's base lr at the last step."""
        return warmup_cosine_ratio(self.last_batch_iteration, **self.params[0])


class OneCycle(_Schedule):
    """``deepspeed.runtime.lr_schedules.OneCycle``."""

    NAME = ONE_CYCLE

    @property
    def min_lrs(self) -> list:
        return self._setting(CYCLE_MIN_LR)

    @property
    def max_lrs(self) -> list:
        return self._setting(CYCLE_MAX_LR)

    @property
    def total_size(self) -> float:
        first, second = self._setting(CYCLE_FIRST_STEP_SIZE)[0], self._setting(CYCLE_SECOND_STEP_SIZE)[0]
        return float(first) + float(first if second is None else second)

    @property
    def step_ratio(self) -> float:
        return float(self._setting(CYCLE_FIRST_STEP_SIZE)[0]) / self.total_size

    @property
    def min_moms(self) -> list:
        return [(m, 0.99) for m in self._setting(CYCLE_MIN_MOM)]

    @property
    def max_moms(self) -> list:
        return [(m, 0.99) for m in self._setting(CYCLE_MAX_MOM)]


class LRRangeTest(_Schedule):
    """``deepspeed.runtime.lr_schedules.LRRangeTest``."""

    NAME = LR_RANGE_TEST

    @property
    def min_lr(self) -> list:
        return self._setting(LR_RANGE_TEST_MIN_LR)

    @property
    def step_size(self) -> int:
        return self._setting(LR_RANGE_TEST_STEP_SIZE)[0]

    @property
    def step_rate(self) -> float:
        return self._setting(LR_RANGE_TEST_STEP_RATE)[0]

    @property
    def staircase(self) -> bool:
        return self._setting(LR_RANGE_TEST_STAIRCASE)[0]


__all__ = [
    "LRRangeTest",
    "get_torch_optimizer",
    "OneCycle",
    "VALID_LR_SCHEDULES",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
]
