"""``deepspeed.module_inject``."""

from . import layers

__all__ = ["layers"]
