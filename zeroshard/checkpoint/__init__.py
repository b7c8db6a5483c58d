"""Sharded, atomic, pickle-free checkpoints that load on any world size and stage, and their consolidation."""

from .consolidate import (
    CheckpointTensors,
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
    read_client_state,
)
from .deepspeed_convert import convert_deepspeed_checkpoint
from .deepspeed_record import read_deepspeed_file
from .deepspeed_universal import read_universal_checkpoint
from .safetensors_io import CheckpointError, Reader
from .universal_export import export_universal_checkpoint

__all__ = [
    "CheckpointError",
    "CheckpointTensors",
    "Reader",
    "convert_deepspeed_checkpoint",
    "convert_zero_checkpoint_to_fp32_state_dict",
    "export_universal_checkpoint",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
    "read_client_state",
    "read_deepspeed_file",
    "read_universal_checkpoint",
]
