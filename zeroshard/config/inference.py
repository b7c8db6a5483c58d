"""Typed config of ``zeroshard.init_inference``: DeepSpeed's inference keys, validated.

Keys come from a config dict/JSON file and from keyword arguments (which win); ``mp_size`` is
DeepSpeed's old name for ``tensor_parallel.tp_size``.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Union

import torch
from pydantic import Field, ValidationError, field_validator, model_validator

from ..precision import DTYPE_NAMES
from .parse import format_validation_error, load_json_or_dict
from .section import Section


class TensorParallelConfig(Section):
    enabled: bool = True
    tp_size: int = Field(1, ge=1)
    vocab_parallel_min_bytes: int = Field(
        0, ge=0, description="embeddings / LM heads smaller than this stay replicated instead of vocab-parallel"
    )


class InferenceConfig(Section):
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig)
    mp_size: Optional[int] = Field(None, ge=1, description="old name of tensor_parallel.tp_size")
    dtype: Optional[Any] = None  # a torch.dtype or one of DTYPE_NAMES' names; None keeps the model's dtype
    checkpoint: Optional[Any] = None  # a state dict or a path (safetensors file, HF directory, zeroshard checkpoint)
    injection_policy: Optional[dict] = None  # {BlockClass or its name: (row-parallel layer names inside it)}
    replace_with_kernel_inject: bool = False

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, value: Any) -> Optional[torch.dtype]:
        if value is None or isinstance(value, torch.dtype):
            if value not in (None, *DTYPE_NAMES.values()):
                raise ValueError(f"unsupported dtype {value}; use one of fp32, bf16, fp16")
            return value
        if isinstance(value, str) and value.lower().removeprefix("torch.") in DTYPE_NAMES:
            return DTYPE_NAMES[value.lower().removeprefix("torch.")]
        raise ValueError(f"unknown dtype {value!r}; use one of {', '.join(DTYPE_NAMES)} or a torch.dtype")

    @field_validator("replace_with_kernel_inject")
    @classmethod
    def _no_kernels(cls, value: bool) -> bool:
        if value:
            raise ValueError(
                "zeroshard has no fused inference kernels to inject; drop replace_with_kernel_inject "
                "(automatic tensor parallelism with torch's scaled_dot_product_attention is used)"
            )
        return value

    @model_validator(mode="after")
    def _mp_size_alias(self) -> "InferenceConfig":
        if self.mp_size is not None:
            if "tp_size" in self.tensor_parallel.model_fields_set and self.tensor_parallel.tp_size != self.mp_size:
                raise ValueError(
                    f"mp_size={self.mp_size} and tensor_parallel.tp_size={self.tensor_parallel.tp_size} disagree; "
                    "keep only tensor_parallel.tp_size"
                )
            self.tensor_parallel.tp_size = self.mp_size
        return self

    @property
    def tp_size(self) -> int:
        return self.tensor_parallel.tp_size if self.tensor_parallel.enabled else 1


def parse_inference_config(config: Union[dict, str, os.PathLike, None], **overrides: Any) -> InferenceConfig:
    """Validate ``config`` (dict or JSON path) with keyword arguments laid over it (those left None are unset)."""
    values = load_json_or_dict(config) if config is not None else {}
    values.update({k: v for k, v in overrides.items() if v is not None})
    if isinstance(values.get("tensor_parallel"), int):  # tensor_parallel=2 as shorthand
        values["tensor_parallel"] = {"tp_size": values["tensor_parallel"]}
    try:
        return InferenceConfig.model_validate(values)
    except ValidationError as err:
        raise ValueError(format_validation_error(err, InferenceConfig, "inference config")) from None
