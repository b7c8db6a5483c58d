"""Mixture of experts across ranks: routing arithmetic (``routing.py``), the token exchange over an expert-parallel
group (``dispatch.py``) and expert parallelism for Hugging Face models with fused experts (``experts.py``)."""

from .dispatch import Dispatched, ExpertDispatch
from .experts import (
    PRESETS,
    ExpertParallelExperts,
    expert_splits,
    find_fused_experts,
    is_fused_experts,
    shard_experts,
)
from .routing import TokenRoute, regroup_by_expert

__all__ = [
    "PRESETS",
    "Dispatched",
    "ExpertDispatch",
    "ExpertParallelExperts",
    "TokenRoute",
    "expert_splits",
    "find_fused_experts",
    "is_fused_experts",
    "regroup_by_expert",
    "shard_experts",
]
