"""``deepspeed.sequence``: DeepSpeed-Ulysses' attention wrapper (its sequence-parallelism tutorial)."""

from . import layer

__all__ = ["layer"]
