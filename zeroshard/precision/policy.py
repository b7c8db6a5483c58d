"""Which dtype each kind of tensor uses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .fp32_buffers import AUTO, FP32Buffers

# dtype names in configs (communication_data_type, grad_accum_dtype, the inference dtype)
DTYPE_NAMES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
}


@dataclass(frozen=True)
class PrecisionPolicy:
    compute: torch.dtype  # parameters in forward/backward and their gradients
    reduce: torch.dtype  # gradients on the wire
    master: torch.dtype = torch.float32  # master weights and optimizer state
    grad: torch.dtype = torch.float32  # reduced gradient shards, accumulated across micro-batches
    buffer: Optional[torch.dtype] = None  # floating buffers (None: each keeps the dtype it has, as DeepSpeed's)
    fp32_buffers: FP32Buffers = AUTO  # buffers kept in fp32 under bf16 / fp16 (fp32_buffers.py)

    @classmethod
    def from_config(cls, config) -> "PrecisionPolicy":
        if config.fp16.enabled:
            compute = torch.float16
        elif config.bf16.enabled:
            compute = torch.bfloat16
        else:
            compute = torch.float32
        if config.fp16.enabled and config.fp16.fp16_master_weights_and_grads:
            raise NotImplementedError("fp16.fp16_master_weights_and_grads: zeroshard keeps fp32 master weights")
        types = config.data_types
        if types.param_dtype is not None and DTYPE_NAMES[types.param_dtype] != compute:
            raise ValueError(
                f"data_types.param_dtype '{types.param_dtype}' conflicts with the precision the fp16 / bf16 blocks "
                f"select ({str(compute).removeprefix('torch.')}); set the matching 'enabled' flag or drop param_dtype"
            )
        reduce = DTYPE_NAMES[config.communication_data_type] if config.communication_data_type else compute
        if config.sequence_parallel_size > 1:  # DeepSpeed's engine swaps in this dtype (default fp32) under Ulysses
            reduce = DTYPE_NAMES[config.seq_parallel_communication_data_type]
        # DeepSpeed's stage 3 keeps gradient partitions in the compute dtype (the 16 bytes/parameter of
        # the ZeRO paper); stages 0-2 accumulate in fp32. data_types.grad_accum_dtype overrides both.
        if types.grad_accum_dtype:
            grad = DTYPE_NAMES[types.grad_accum_dtype]
        else:
            grad = compute if config.zero_optimization.stage == 3 else torch.float32
        buffer = DTYPE_NAMES[types.buffer_dtype] if types.buffer_dtype else None
        kept = types.keep_in_fp32_modules
        return cls(compute, reduce, grad=grad, buffer=buffer, fp32_buffers=kept if kept == AUTO else tuple(kept))
