"""DeepSpeed's expert-parameter protocol on a model: which parameters are a rank's own experts, over how many expert
ranks, and how each is cut, read from the tags clients write (``allreduce = False``, ``group_name = "ep_size_<N>"``,
as ArcticTraining tags its fused expert tensors) and from DeepSpeed's MoE layers (``layer.py``). ``initialize``
places them with it, ``zeroshard estimate`` counts them with it."""

from __future__ import annotations

import re
from typing import Optional

import torch

from ..partition import TensorSplit
from .layer import moe_layers


def tagged_experts(model: torch.nn.Module) -> dict:
    """The parameters tagged ``allreduce = False`` outside DeepSpeed's MoE layers, with their group name. A tagged
    tensor must stack this rank's experts along dim 0 (``[local_experts, ...]``: ArcticTraining's and transformers'
    fused layout), so a checkpoint can describe the experts whole; anything else is refused by name."""
    tagged = {}
    layered = {p for layer in moe_layers(model) for p in layer.experts.parameters()}  # DeepSpeed's layers: apart
    for name, param in model.named_parameters():
        if not hasattr(param, "allreduce") or param.allreduce or param in layered:
            continue
        group = getattr(param, "group_name", None)
        if not isinstance(group, str) or not re.fullmatch(r"ep_size_[1-9][0-9]*", group):
            raise NotImplementedError(
                f"parameter '{name}' is tagged allreduce=False (an expert parameter) with group_name {group!r}; "
                "DeepSpeed's protocol names the expert group 'ep_size_<N>'"
            )
        if param.dim() < 3:
            raise NotImplementedError(
                f"parameter '{name}' ({list(param.shape)}) is tagged allreduce=False but is not a stack of experts "
                "[local_experts, ...]: one tensor per expert is taken through deepspeed.moe.layer.MoE only (it names "
                "each copy's global expert); stack the experts (fused, as ArcticTraining and transformers 5 do)"
            )
        tagged[param] = group
    return tagged


def declared_expert_parallel(model: torch.nn.Module) -> Optional[int]:
    """The expert-parallel size the model's tags and MoE layers declare, or None when it declares none."""
    sizes = {int(g.removeprefix("ep_size_")) for g in tagged_experts(model).values()}
    sizes |= {layer.ep_size for layer in moe_layers(model)}
    if len(sizes) > 1:
        names = sorted(f"ep_size_{size}" for size in sizes)
        raise NotImplementedError(
            f"expert parameters of several expert-parallel sizes ({names}): one expert group size per model is "
            "implemented"
        )
    return next(iter(sizes), None)


def declared_expert_pieces(model: torch.nn.Module, ep: int) -> dict:
    """Each declared expert parameter with how the whole is cut over ``ep`` expert ranks: tagged stacks along dim 0,
    DeepSpeed's layer copies one expert each (``listed``; with ``ep`` 1 they are ordinary parameters)."""
    pieces = {param: TensorSplit(0, ep, axis="ep") for param in tagged_experts(model)}
    if ep > 1:
        pieces.update(
            {
                p: TensorSplit(0, ep, axis="ep", listed=True)
                for layer in moe_layers(model)
                for p in layer.experts.parameters()
            }
        )
    return pieces
