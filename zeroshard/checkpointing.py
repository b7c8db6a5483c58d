"""``zeroshard.checkpointing``: DeepSpeed's activation-checkpointing API (see
:mod:`zeroshard.runtime.activation_checkpointing`)."""

from .runtime.activation_checkpointing import (
    checkpoint,
    configure,
    is_configured,
    non_reentrant_checkpoint,
    reset,
)

__all__ = ["checkpoint", "configure", "is_configured", "non_reentrant_checkpoint", "reset"]
