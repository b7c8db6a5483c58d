"""``deepspeed.checkpointing``: activation checkpointing (recompute in backward instead of storing)."""

from zeroshard.runtime.activation_checkpointing import (
    checkpoint,
    configure,
    is_configured,
    non_reentrant_checkpoint,
    reset,
)

__all__ = ["checkpoint", "configure", "is_configured", "non_reentrant_checkpoint", "reset"]
