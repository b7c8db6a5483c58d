"""``deepspeed.checkpointing``: activation checkpointing (recompute in backward instead of storing)."""

from zeroshard.runtime.activation_checkpointing import checkpoint, configure, is_configured

__all__ = ["checkpoint", "configure", "is_configured"]
