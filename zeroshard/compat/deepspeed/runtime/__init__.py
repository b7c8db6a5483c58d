"""``deepspeed.runtime``."""

from . import base_optimizer, config, engine, lr_schedules, sequence_parallel, zero

__all__ = ["base_optimizer", "config", "engine", "lr_schedules", "sequence_parallel", "zero"]
