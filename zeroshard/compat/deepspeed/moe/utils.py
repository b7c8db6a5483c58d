"""``deepspeed.moe.utils``: DeepSpeed's expert-parameter protocol. An expert parameter carries ``allreduce = False``
(it differs across the ranks of its expert group) and ``group_name = "ep_size_<N>"``; optimizer groups of expert
parameters carry ``"moe": True`` and that name. ``zeroshard.initialize`` reads the same tags
(``runtime.parallelize``)."""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from zeroshard.moe import MoE

DEFAULT_MAX_GROUP_SIZE = 178956971  # DeepSpeed's default elements per expert optimizer group


def is_moe_param(param: torch.Tensor) -> bool:
    """An expert parameter: tagged ``allreduce = False``."""
    return hasattr(param, "allreduce") and not param.allreduce


def has_moe_layers(module: torch.nn.Module) -> tuple[bool, int]:
    """Whether ``module`` holds DeepSpeed's ``MoE`` layer, and the first one's expert count."""
    first = next((m for m in module.modules() if isinstance(m, MoE)), None)
    return (True, first.num_experts) if first is not None else (False, 0)


def split_params_into_shared_and_expert_params(params: list) -> tuple[list, list]:
    shared = [p for p in params if not is_moe_param(p)]
    return shared, [p for p in params if is_moe_param(p)]


def split_params_grads_into_shared_and_expert_params(group: list) -> tuple[list, list]:
    """The gradients of ``group``'s parameters that have one, shared first."""
    with_grad = [p for p in group if p.grad is not None]
    shared, experts = split_params_into_shared_and_expert_params(with_grad)
    return [p.grad for p in shared], [p.grad for p in experts]


def _as_list(param_groups: Any) -> list[dict]:
    if isinstance(param_groups, dict):
        return [param_groups]
    if isinstance(param_groups, (list, tuple)):
        return list(param_groups)
    raise ValueError(f"Unknown param group type of {type(param_groups)}")


def split_params_into_different_moe_groups_for_optimizer(
    param_groups: Union[dict, list, tuple], max_group_size: Optional[Union[int, float]] = DEFAULT_MAX_GROUP_SIZE
) -> list[dict]:
    """Move each group's expert parameters into groups of their own, one per expert group name (``"moe": True``,
    ``"name"``: the group name, the other hyperparameters copied), appended after the given groups and cut at
    ``max_group_size`` elements, as DeepSpeed does. Without expert parameters the groups come back as they are."""
    groups = _as_list(param_groups)
    names = sorted({p.group_name for g in groups for p in g["params"] if is_moe_param(p)})
    added = []
    for group in groups:
        experts = {name: [p for p in group["params"] if is_moe_param(p) and p.group_name == name] for name in names}
        group["params"] = [p for p in group["params"] if not is_moe_param(p)]
        if names and "name" not in group:
            raise KeyError("name")  # DeepSpeed keys its expert groups by the original group's name
        for name in names:
            for chunk in _chunks(experts[name], max_group_size):
                added.append({**group, "name": name, "moe": True, "params": chunk})
    return groups + added


def _chunks(params: list, max_group_size: Optional[Union[int, float]]) -> list[list]:
    """``params`` in runs of at most ``max_group_size`` elements (a larger parameter alone); one run when None."""
    if max_group_size is None:
        return [params]
    runs, current, size = [], [], 0
    for param in params:
        if current and size + param.numel() > max_group_size:
            runs.append(current)
            current, size = [], 0
        current.append(param)
        size += param.numel()
    return runs + [current] if current else runs


def is_moe_param_group(param_group: dict) -> bool:
    return bool(param_group.get("moe", False))


def configure_moe_param_groups(model_parameters: Any) -> list[dict]:
    """Parameters or groups as the optimizer takes them, with expert parameters in their own groups (groups that
    already have ``moe`` keys are kept)."""
    params = list(model_parameters)
    if params and isinstance(params[0], torch.nn.Parameter):
        return split_params_into_different_moe_groups_for_optimizer({"params": params, "name": "dense-params"})
    if any("moe" in group for group in params):
        return params
    return split_params_into_different_moe_groups_for_optimizer(params)


__all__ = [
    "configure_moe_param_groups",
    "has_moe_layers",
    "is_moe_param",
    "is_moe_param_group",
    "split_params_grads_into_shared_and_expert_params",
    "split_params_into_different_moe_groups_for_optimizer",
    "split_params_into_shared_and_expert_params",
]
