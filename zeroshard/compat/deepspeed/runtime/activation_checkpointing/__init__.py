"""``deepspeed.runtime.activation_checkpointing``: where DeepSpeed keeps ``checkpointing`` (``deepspeed.checkpointing``
is the same module's names)."""

from . import checkpointing

__all__ = ["checkpointing"]
