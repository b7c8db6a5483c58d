"""``deepspeed.runtime.utils``: the helpers DeepSpeed's tutorials and clients import (``move_to_device`` in the
ALST tutorial, ``see_memory_usage``, ``clip_grad_norm_``), with DeepSpeed's signatures."""

from __future__ import annotations

import gc
import math
from typing import Any, Callable, Iterable, Optional, Union

import torch

from zeroshard import comm
from zeroshard.accelerator import get_accelerator, host_rss
from zeroshard.pipe import partition_balanced, partition_uniform

from .._not_built import not_built


def move_to_device(item: Any, device: Union[str, torch.device], criterion_func: Optional[Callable] = None) -> Any:
    """``item`` (a tensor, or lists / tuples / dicts of them) on ``device``. As DeepSpeed: a tensor that
    ``criterion_func`` selects is moved in place (its ``.data`` swapped) and returned; without a criterion every
    tensor is copied with ``.to(device)``; other leaves come back as they are."""
    if criterion_func is not None and criterion_func(item):
        item.data = item.to(device).data
        return item
    if isinstance(item, list):
        return [move_to_device(v, device, criterion_func) for v in item]
    if isinstance(item, tuple):
        return tuple(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    return item.to(device) if isinstance(item, torch.Tensor) and criterion_func is None else item


def see_memory_usage(message: str, force: bool = False) -> None:
    """Print ``message`` with the device's and the host's memory on rank 0, only when ``force`` (as DeepSpeed)."""
    if not force or comm.get_rank() != 0:
        return
    gc.collect()
    accel, gib = get_accelerator(), 1024**3
    print(message)
    print(
        f"MA {accel.memory_allocated() / gib:.2f} GB  Max_MA {accel.max_memory_allocated() / gib:.2f} GB  "
        f"host RSS {host_rss() / gib:.2f} GB"
    )


def clip_grad_norm_(
    parameters: Union[torch.Tensor, Iterable[torch.Tensor]], max_norm: float, norm_type: float = 2, mpu: Any = None
) -> torch.Tensor:
    """Clip the gradients of ``parameters`` (whole gradients, as a plain or stage-0/1 model holds them) to
    ``max_norm`` and return their total norm. ``mpu`` (model parallelism through Megatron's object) is refused;
    unlike DeepSpeed's, the norm is not averaged over the data-parallel ranks, whose gradients are equal after the
    reduction. An engine clips by itself with the config's ``gradient_clipping``."""
    if mpu is not None:
        raise NotImplementedError("deepspeed.runtime.utils.clip_grad_norm_(mpu=...): Megatron's mpu is not supported")
    if not isinstance(max_norm, (int, float)) or isinstance(max_norm, bool) or not math.isfinite(max_norm):
        raise ValueError(f"clip_grad_norm_: max_norm must be a finite number, got {max_norm!r}")
    return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)


def is_model_parallel_parameter(p: torch.Tensor) -> bool:
    """DeepSpeed's test: the parameter carries Megatron's flag of a tensor-parallel piece (``model_parallel`` or
    ``tensor_model_parallel``, set by the client's layers)."""
    return bool(getattr(p, "model_parallel", False) or getattr(p, "tensor_model_parallel", False))


def _from_meta(*args: Any, **kwargs: Any) -> None:
    PartitionedTensor()  # the refusal, naming the class


PartitionedTensor = not_built(
    "deepspeed.runtime.utils.PartitionedTensor",
    "pipeline activations are split over the tensor group by the engine itself (pipeline.pipe_partitioned)",
    from_meta=staticmethod(_from_meta),
)

__all__ = [
    "PartitionedTensor",
    "clip_grad_norm_",
    "is_model_parallel_parameter",
    "move_to_device",
    "partition_balanced",
    "partition_uniform",
    "see_memory_usage",
]
