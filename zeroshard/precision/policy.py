"""Which dtype each kind of tensor uses."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class PrecisionPolicy:
    compute: torch.dtype  # parameters in forward/backward and their gradients
    reduce: torch.dtype  # gradients on the wire
    master: torch.dtype = torch.float32  # master weights, gradient shards and optimizer state

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
        reduce = _DTYPES[config.communication_data_type] if config.communication_data_type else compute
        return cls(compute=compute, reduce=reduce)
