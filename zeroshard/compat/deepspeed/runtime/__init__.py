"""``deepspeed.runtime``."""

from . import base_optimizer, engine, lr_schedules, zero

__all__ = ["base_optimizer", "engine", "lr_schedules", "zero"]
