"""How the optimizer over the master shards is built from what the client gave ``initialize``: its optimizer object
(adopted: its groups re-pointed at the shards), a callable ``params -> optimizer``, or the config's ``optimizer``
block. Each receives the shards' layout (``zeroshard.optim.contract``): at construction when built by name, through
``bind_layout`` when the client built it."""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch

from ..offload import OffloadPlan
from ..optim import bind_layout, build_optimizer, check_client_optimizer, muon_param_groups
from ..optim.contract import ShardLayout
from ..zero.optimizer_state import MakeOptimizer

OptimizerArg = Union[torch.optim.Optimizer, Callable[..., torch.optim.Optimizer], None]


def _param_groups(module: torch.nn.Module, model_parameters: Any) -> list[dict]:
    if model_parameters is None:
        return [{"params": list(module.parameters())}]
    items = list(model_parameters)
    if items and isinstance(items[0], dict):
        return [{**g, "params": list(g["params"])} for g in items]
    return [{"params": items}]


def optimizer_recipe(
    optimizer: OptimizerArg, model: torch.nn.Module, model_parameters: Any, cfg, offload: OffloadPlan
) -> tuple[list[dict], MakeOptimizer]:
    """The parameter groups to shard, and how to build the optimizer over their master shards: the client's
    optimizer object (its groups re-pointed at the shards, so a scheduler bound to it keeps working), a client
    callable ``params -> optimizer``, or the config's ``optimizer`` block."""
    stage, allow_untested = cfg.zero_optimization.stage, cfg.zero_allow_untested_optimizer
    force_cpu_optimizer = offload.offloads_optimizer and cfg.zero_force_ds_cpu_optimizer

    if isinstance(optimizer, torch.optim.Optimizer):
        if cfg.optimizer is not None:
            raise ValueError("both a client optimizer and an 'optimizer' config block were given; drop one")
        check_client_optimizer(optimizer, stage, allow_untested, force_cpu_optimizer)

        def adopt(master_groups: list[dict], layout: Optional[ShardLayout]) -> torch.optim.Optimizer:
            for target, group in zip(optimizer.param_groups, master_groups):
                target["params"] = group["params"]
            optimizer.state.clear()
            return bind_layout(optimizer, layout)

        return [dict(g) for g in optimizer.param_groups], adopt
    groups = _param_groups(model, model_parameters)
    if optimizer is not None:

        def build_client(master_groups: list[dict], layout: Optional[ShardLayout]) -> torch.optim.Optimizer:
            built = optimizer(master_groups)
            check_client_optimizer(built, stage, allow_untested, force_cpu_optimizer)
            return bind_layout(built, layout)

        return groups, build_client

    if cfg.optimizer is not None and cfg.optimizer.type.lower() == "muon":  # Muon's matrices, AdamW's the rest
        groups = muon_param_groups(model.named_parameters(), groups, cfg.optimizer.params)

    def build_configured(master_groups: list[dict], layout: Optional[ShardLayout]) -> torch.optim.Optimizer:
        return build_optimizer(
            cfg.optimizer.type,
            cfg.optimizer.params,
            master_groups,
            zero_stage=stage,
            allow_untested=allow_untested,
            layout=layout,
        )

    return groups, build_configured


__all__ = ["OptimizerArg", "optimizer_recipe"]
