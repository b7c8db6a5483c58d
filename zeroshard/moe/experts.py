"""Expert parallelism for Hugging Face MoE models whose experts are fused 3-D tensors (transformers 5: Mixtral,
Qwen3-MoE, ...): DeepSpeed's AutoEP, without changing the model's code or its parameter names.

A fused experts module holds ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` and is called as
``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])`` by its MoE block, after the block's router.
:func:`shard_experts` replaces each such module with an :class:`ExpertParallelExperts` that keeps this rank's
``E / ep`` experts under the same names (``...mlp.experts.gate_up_proj`` is now ``[E / ep, 2I, H]``), sends each
row to the rank holding its expert and back (:class:`~zeroshard.moe.dispatch.ExpertDispatch`), and computes
``down(act(gate) * up)`` per expert, as the one-process module does. Routers, attention and everything else stay
replicated. Every expert takes part in every step's graph, so an expert that received no token gets a zero
gradient, never a missing one. When the expert group takes in tensor ranks (AutoEP folded with AutoTP), those ranks
hold the same tokens: each routes its block of them and the outputs are gathered back over the tensor group, so no
expert computes a token twice.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .. import comm
from ..comm.autograd import gather_from_group, scatter_to_group
from ..partition import TensorSplit
from .dispatch import ExpertDispatch

# DeepSpeed's AutoEP preset names zeroshard accepts -> the model types (``config.model_type``) each covers
PRESETS = {"mixtral": ("mixtral",), "qwen3_moe": ("qwen3_moe", "qwen2_moe")}
FUSED = ("gate_up_proj", "down_proj")


class ExpertParallelExperts(torch.nn.Module):
    """This rank's experts of one fused experts module, and the token exchange over the expert-parallel group."""

    def __init__(self, experts: torch.nn.Module, group: comm.Group, sharing_tokens: Optional[comm.Group] = None):
        super().__init__()
        total = experts.gate_up_proj.shape[0]
        self.dispatch = ExpertDispatch(group, total)
        self.sharing_tokens = sharing_tokens  # tensor ranks holding the same tokens: each routes its block of them
        self.num_experts = self.dispatch.local_experts
        self.num_global_experts = total
        first = group.rank * self.num_experts
        for name in FUSED:
            whole = getattr(experts, name)
            piece = whole.detach()[first : first + self.num_experts].clone()
            setattr(self, name, torch.nn.Parameter(piece, requires_grad=whole.requires_grad))
        self.act_fn = experts.act_fn

    def splits(self) -> dict[str, TensorSplit]:
        """How each of its parameters is cut from the whole tensor: along the expert dimension over the group."""
        return {name: TensorSplit(0, self.dispatch.group.size, axis="ep") for name in FUSED}

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        tokens, shared = hidden_states.shape[0], self.sharing_tokens
        if shared is not None:  # the expert group spans tensor ranks: each routes its block of their tokens
            hidden_states = scatter_to_group(hidden_states, shared)
            top_k_weights = scatter_to_group(top_k_weights, shared)
            top_k_index = scatter_to_group(top_k_index, shared)
        rows, per_expert, dispatched = self.dispatch.send(hidden_states, top_k_index)
        outputs = []
        for expert, chunk in enumerate(rows.split(per_expert)):
            gate, up = F.linear(chunk, self.gate_up_proj[expert]).chunk(2, dim=-1)
            outputs.append(F.linear(self.act_fn(gate) * up, self.down_proj[expert]))
        combined = self.dispatch.combine(torch.cat(outputs), top_k_weights, dispatched)
        return combined if shared is None else gather_from_group(combined, shared, dim=0, total=tokens)


def is_fused_experts(module: torch.nn.Module) -> bool:
    """A transformers fused experts module in the layout :class:`ExpertParallelExperts` computes."""
    params = dict(module.named_parameters(recurse=False))
    return set(params) == set(FUSED) and all(p.dim() == 3 for p in params.values()) and hasattr(module, "act_fn")


def _check_layout(path: str, module: torch.nn.Module) -> None:
    """Refuse, by name, a fused experts module in another layout (biases, transposed or interleaved weights, no gate,
    a norm after each expert) or one transformers already split over its own expert-parallel group."""
    if getattr(module, "_is_expert_parallel", False):
        raise NotImplementedError(
            f"'{path}' is already split over an expert-parallel group by transformers (DistributedConfig / "
            "base_model_ep_plan); load the model without it and let zeroshard split the experts (expert_parallel)"
        )
    layout = {"has_bias": False, "is_transposed": False, "has_gate": True, "is_concatenated": True}
    layout["has_post_expert_norm"] = False
    different = {k: getattr(module, k) for k, want in layout.items() if getattr(module, k, want) != want}
    if different:
        raise NotImplementedError(
            f"'{path}' ({type(module).__name__}) has a fused expert layout zeroshard does not split: {different}"
        )


def find_fused_experts(model: torch.nn.Module, preset: Optional[str] = None) -> list[tuple[str, torch.nn.Module]]:
    """The fused experts modules of ``model`` (path, module), checked against ``preset`` (a name of
    :data:`PRESETS`) when given."""
    if preset is not None:
        if preset not in PRESETS:
            raise NotImplementedError(
                f"config key 'expert_parallel.preset_model' = {preset!r} is not implemented by zeroshard (it has "
                f"{sorted(PRESETS)}; other models with fused experts are found without a preset)"
            )
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if model_type not in PRESETS[preset]:
            raise ValueError(
                f"expert_parallel.preset_model {preset!r} is for model types {list(PRESETS[preset])}, this model is "
                f"{model_type!r}"
            )
    found = [(path, m) for path, m in model.named_modules() if is_fused_experts(m)]
    for path, module in found:
        _check_layout(path, module)
    return found


def shard_experts(
    model: torch.nn.Module,
    group: comm.Group,
    preset: Optional[str] = None,
    sharing_tokens: Optional[comm.Group] = None,
) -> dict:
    """Split every fused experts module of ``model`` over ``group`` (in place; every rank must hold the same
    weights). ``sharing_tokens``: the tensor group, when the expert group spans its ranks (their tokens are the
    same; each routes its block). Returns this rank's expert pieces, each parameter mapped to how the whole tensor is
    cut."""
    found = find_fused_experts(model, preset)
    if not found:
        raise ValueError(
            "expert_parallel is enabled but the model has no fused experts module (gate_up_proj [E, 2I, H] and "
            "down_proj [E, H, I], as transformers 5 builds Mixtral and Qwen3-MoE)"
        )
    pieces = {}
    for path, module in found:
        total = module.gate_up_proj.shape[0]
        if total % group.size:
            raise ValueError(f"expert_parallel.autoep_size {group.size} must divide the {total} experts of '{path}'")
        parallel = ExpertParallelExperts(module, group, sharing_tokens)
        parent_path, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent_path), name, parallel)
        pieces.update({getattr(parallel, n): split for n, split in parallel.splits().items()})
    return pieces
