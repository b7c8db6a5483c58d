"""``deepspeed.runtime``."""

from . import base_optimizer, checkpoint_engine, config, engine, lr_schedules, sequence_parallel, utils, zero

__all__ = [
    "base_optimizer", "checkpoint_engine", "config", "engine", "lr_schedules", "sequence_parallel", "utils", "zero"
]  # fmt: skip
