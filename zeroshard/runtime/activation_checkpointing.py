"""Activation checkpointing under DeepSpeed's names: recompute a segment's activations in backward instead of
keeping them. Non-reentrant (``torch.utils.checkpoint`` with ``use_reentrant=False``): it composes with ZeRO's
gradient hooks and stage-3 gathers, and works when no input requires a gradient.

DeepSpeed's extras (partitioning activations across model-parallel ranks, CPU checkpointing, contiguous
buffers) are not implemented; asking for them is refused, never ignored."""

from __future__ import annotations

from typing import Any, Optional

import torch.utils.checkpoint

_configured = False  # DeepSpeed reports whether configure() ran; nothing else depends on it


def checkpoint(function, *args, **kwargs) -> Any:
    """Run ``function(*args, **kwargs)`` without keeping its intermediate activations."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)


def configure(
    mpu_: Any = None,
    deepspeed_config: Any = None,
    partition_activations: Optional[bool] = None,
    contiguous_checkpointing: Optional[bool] = None,
    num_checkpoints: Optional[int] = None,
    checkpoint_in_cpu: Optional[bool] = None,
    synchronize: Optional[bool] = None,
    profile: Optional[bool] = None,
) -> None:
    """Accept DeepSpeed's call; refuse the options that would change memory behaviour zeroshard does not have."""
    global _configured
    asked = {
        "partition_activations": partition_activations,
        "contiguous_checkpointing": contiguous_checkpointing,
        "checkpoint_in_cpu": checkpoint_in_cpu,
        "synchronize": synchronize,
        "profile": profile,
    }
    refused = sorted(name for name, value in asked.items() if value)
    if mpu_ is not None:
        refused.insert(0, "mpu_")
    if refused:
        raise NotImplementedError(
            f"activation checkpointing options {refused} are not supported by zeroshard; plain recomputation "
            "(zeroshard.checkpointing.checkpoint / torch.utils.checkpoint) is"
        )
    _configured = True


def is_configured() -> bool:
    return _configured
