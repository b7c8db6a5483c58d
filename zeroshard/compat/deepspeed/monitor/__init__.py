"""``deepspeed.monitor``."""

from . import monitor

__all__ = ["monitor"]
