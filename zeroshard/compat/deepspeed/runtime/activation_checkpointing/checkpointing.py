"""``deepspeed.runtime.activation_checkpointing.checkpointing``: activation checkpointing as ``deepspeed.checkpointing``
serves it, plus DeepSpeed's ``detach_variable`` (qlora-pipe's unsloth-style checkpoint imports it)."""

from __future__ import annotations

from typing import Any, Optional

import torch

from ...checkpointing import checkpoint, configure, is_configured, non_reentrant_checkpoint, reset


def detach_variable(inputs: tuple, device: Optional[Any] = None) -> tuple:
    """``inputs`` with every tensor detached (moved to ``device`` when given), each keeping whether it required
    a gradient; other values as they are. DeepSpeed's helper for checkpoint functions of its shape."""
    if not isinstance(inputs, tuple):
        raise TypeError(f"detach_variable takes a tuple of inputs, got {type(inputs).__name__}")
    detached = []
    for value in inputs:
        if isinstance(value, torch.Tensor):
            copy = (value.to(device) if device is not None else value).detach()
            copy.requires_grad = value.requires_grad
            detached.append(copy)
        else:
            detached.append(value)
    return tuple(detached)


__all__ = ["checkpoint", "configure", "detach_variable", "is_configured", "non_reentrant_checkpoint", "reset"]
