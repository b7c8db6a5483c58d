"""``deepspeed.utils.zero_to_fp32`` with DeepSpeed's signatures: full fp32 weights out of a sharded checkpoint
(zeroshard's format; DeepSpeed's own files are imported with ``zeroshard convert --from-deepspeed``), and the
file-listing helpers Lightning calls on DeepSpeed's checkpoint layout."""

from __future__ import annotations

import glob
import os
import re
from typing import Optional, Union

import torch

from zeroshard.checkpoint import consolidate


def _no_frozen_exclusion(exclude_frozen_parameters: bool, call: str) -> None:
    if exclude_frozen_parameters:
        raise NotImplementedError(
            f"deepspeed.utils.zero_to_fp32.{call}(exclude_frozen_parameters=True): save the checkpoint with "
            "save_checkpoint(..., exclude_frozen_parameters=True) instead; it then holds no frozen parameters"
        )


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: Union[str, os.PathLike],
    tag: Optional[str] = None,
    exclude_frozen_parameters: bool = False,
    lazy_mode: bool = False,
) -> dict[str, torch.Tensor]:
    """The fp32 weights as one state dict (``lazy_mode`` is accepted; the tensors are read at once)."""
    _no_frozen_exclusion(exclude_frozen_parameters, "get_fp32_state_dict_from_zero_checkpoint")
    return consolidate.get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: Union[str, os.PathLike],
    output_dir: Union[str, os.PathLike],
    max_shard_size: Union[int, str] = "5GB",
    safe_serialization: bool = False,
    tag: Optional[str] = None,
    exclude_frozen_parameters: bool = False,
) -> list[str]:
    """DeepSpeed's defaults: ``pytorch_model.bin`` (tensors only) in ``output_dir``, or safetensors with
    ``safe_serialization=True`` (zeroshard's own ``convert_zero_checkpoint_to_fp32_state_dict`` writes safetensors
    by default)."""
    _no_frozen_exclusion(exclude_frozen_parameters, "convert_zero_checkpoint_to_fp32_state_dict")
    return consolidate.convert_zero_checkpoint_to_fp32_state_dict(
        checkpoint_dir, output_dir, tag=tag, max_shard_size=max_shard_size, safe_serialization=safe_serialization
    )


OUTPUT_DTYPE_NAMES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def convert_zero_checkpoint_to_state_dict(
    checkpoint_dir: Union[str, os.PathLike],
    output_dir: Union[str, os.PathLike],
    dtype: Union[str, torch.dtype] = torch.float32,
    max_shard_size: Union[int, str] = "5GB",
    safe_serialization: bool = False,
    tag: Optional[str] = None,
    exclude_frozen_parameters: bool = False,
) -> list[str]:
    """DeepSpeed 0.19.8's converter: the weights with floating-point tensors in ``dtype`` (fp32, fp16 or bf16)."""
    _no_frozen_exclusion(exclude_frozen_parameters, "convert_zero_checkpoint_to_state_dict")
    return consolidate.convert_zero_checkpoint_to_fp32_state_dict(
        checkpoint_dir,
        output_dir,
        tag=tag,
        max_shard_size=max_shard_size,
        safe_serialization=safe_serialization,
        dtype=dtype,
    )


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir, tag: Optional[str] = None):
    return consolidate.load_state_dict_from_zero_checkpoint(model.cpu(), checkpoint_dir, tag)


def _natural(text: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def get_checkpoint_files(checkpoint_dir: Union[str, os.PathLike], glob_pattern: str) -> list[str]:
    """The files of a DeepSpeed tag directory matching ``glob_pattern``, in rank order."""
    found = sorted(glob.glob(os.path.join(glob.escape(os.fspath(checkpoint_dir)), glob_pattern)), key=_natural)
    if not found:
        raise FileNotFoundError(f"can't find {glob_pattern} files in directory '{checkpoint_dir}'")
    return found


def get_optim_files(checkpoint_dir: Union[str, os.PathLike]) -> list[str]:
    return get_checkpoint_files(checkpoint_dir, "*_optim_states.pt")


def get_model_state_files(checkpoint_dir: Union[str, os.PathLike]) -> list[str]:
    return get_checkpoint_files(checkpoint_dir, "*_model_states.pt")


def get_model_state_file(checkpoint_dir: Union[str, os.PathLike], zero_stage: int) -> str:
    """DeepSpeed's model-states file of a tag directory for ``zero_stage`` (1-2: ``mp_rank_00``, 3: rank 0's)."""
    if not os.path.isdir(checkpoint_dir):
        raise FileNotFoundError(f"Directory '{checkpoint_dir}' doesn't exist")
    name = "zero_pp_rank_0_mp_rank_00_model_states.pt" if zero_stage == 3 else "mp_rank_00_model_states.pt"
    path = os.path.join(checkpoint_dir, name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"can't find model states file at '{path}'")
    return path


__all__ = [
    "OUTPUT_DTYPE_NAMES",
    "convert_zero_checkpoint_to_fp32_state_dict",
    "convert_zero_checkpoint_to_state_dict",
    "get_checkpoint_files",
    "get_fp32_state_dict_from_zero_checkpoint",
    "get_model_state_file",
    "get_model_state_files",
    "get_optim_files",
    "load_state_dict_from_zero_checkpoint",
]
