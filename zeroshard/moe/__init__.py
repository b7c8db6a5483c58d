"""Mixture of experts across ranks: routing arithmetic (``routing.py``), capacity gating as DeepSpeed computes it
(``gating.py``), the token exchange over an expert-parallel group (``dispatch.py``), expert parallelism for Hugging
Face models with fused experts (``experts.py``) and DeepSpeed's MoE layer (``layer.py``)."""

from .dispatch import Dispatched, ExpertDispatch
from .experts import (
    PRESETS,
    ExpertParallelExperts,
    find_fused_experts,
    is_fused_experts,
    shard_experts,
)
from .gating import Gated, capacity, top1, top2
from .layer import MoE, MOELayer, expert_names, moe_layers
from .routing import TokenRoute, regroup_by_expert
from .tags import declared_expert_parallel, declared_expert_pieces, tagged_experts

__all__ = [
    "MOELayer",
    "MoE",
    "PRESETS",
    "Gated",
    "capacity",
    "declared_expert_parallel",
    "declared_expert_pieces",
    "expert_names",
    "moe_layers",
    "top1",
    "top2",
    "Dispatched",
    "ExpertDispatch",
    "ExpertParallelExperts",
    "TokenRoute",
    "find_fused_experts",
    "is_fused_experts",
    "regroup_by_expert",
    "shard_experts",
    "tagged_experts",
]
