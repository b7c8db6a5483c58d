"""A Lightning checkpoint directory (saved by ``ZeroshardStrategy``) as one file ``load_from_checkpoint`` accepts."""

from __future__ import annotations

import os
from typing import Optional

import torch
from safetensors.torch import save_file

from zeroshard.checkpoint import get_fp32_state_dict_from_zero_checkpoint, read_client_state


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str, output_file: str, tag: Optional[str] = None
) -> dict:
    """Write the checkpoint's fp32 weights and Lightning's state (hyperparameters, loops, callbacks) to
    ``output_file``, which ``MyModule.load_from_checkpoint(output_file)`` and ``Trainer(ckpt_path=...)`` accept (a
    ``torch.save`` file, as Lightning reads). With a ``.safetensors`` name it writes the weights only (no pickle).
    Returns what was written."""
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    directory = os.path.dirname(os.path.abspath(output_file))
    os.makedirs(directory, exist_ok=True)
    if output_file.endswith(".safetensors"):
        tensors = {name: value.contiguous() for name, value in state_dict.items()}
        shared = {}
        for name, value in tensors.items():  # safetensors refuses aliases: store each storage once
            shared.setdefault(value.untyped_storage().data_ptr(), name)
        unique = {name: value for name, value in tensors.items() if shared[value.untyped_storage().data_ptr()] == name}
        save_file(unique, output_file)
        return unique
    checkpoint = read_client_state(checkpoint_dir, tag)
    checkpoint["state_dict"] = state_dict
    torch.save(checkpoint, output_file)
    return checkpoint
