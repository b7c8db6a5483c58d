"""``deepspeed.moe.utils``."""

from __future__ import annotations

from typing import Any


def is_moe_param(param) -> bool:
    """No parameter is an expert parameter: zeroshard has no mixture-of-experts layers."""
    return False


def split_params_into_different_moe_groups_for_optimizer(param_groups: Any, max_group_size: Any = None) -> list[dict]:
    """DeepSpeed splits expert parameters into their own optimizer groups. Without experts that is the identity:
    the groups come back as a list of dicts, each with its own ``params`` list."""
    if isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    return [{**group, "params": list(group["params"])} for group in param_groups]


__all__ = ["is_moe_param", "split_params_into_different_moe_groups_for_optimizer"]
