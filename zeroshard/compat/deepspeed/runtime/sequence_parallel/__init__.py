"""``deepspeed.runtime.sequence_parallel``."""

from . import ulysses_sp

__all__ = ["ulysses_sp"]
