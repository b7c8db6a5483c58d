"""``deepspeed.runtime.zero.partition_parameters``: the names Hugging Face reaches for in this module."""

import torch

from zeroshard.compat.deepspeed.accelerator import get_accelerator
from zeroshard.compat.deepspeed.zero import ZeroParamStatus, register_external_parameter
from zeroshard.zero import GatheredParameters, Init

_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(fn, target_fp_dtype=None, target_device=None):
    """DeepSpeed's Init re-types tensor constructors called inside it; zeroshard's Init leaves constructors alone
    (only registered parameters change), so this returns ``fn`` unchanged. It exists because clients swap it
    (Hugging Face's ``prevent_arange_dtype_change``)."""
    return fn


__all__ = [
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "get_accelerator",
    "register_external_parameter",
    "zero_wrapper_for_fp_tensor_constructor",
]
