"""``deepspeed.checkpoint``."""

from . import ds_to_universal, utils

__all__ = ["ds_to_universal", "utils"]
