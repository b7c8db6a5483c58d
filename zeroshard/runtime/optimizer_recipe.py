"""How the optimizer over the master shards is built from what the client gave ``initialize``: its optimizer object
(adopted: its groups re-pointed at the shards), a callable ``params -> optimizer``, or the config's ``optimizer``
block; and what tensor parallelism refuses among them."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Union

import torch

from ..offload import OffloadPlan
from ..optim import (
    WHOLE_PARAMETER_OPTIMIZERS,
    Lamb,
    OneBitLamb,
    OneBitOptimizer,
    ShardedNorms,
    ZeroOneAdam,
    build_optimizer,
    check_client_optimizer,
    muon_param_groups,
)
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

    def shard_aware(built: torch.optim.Optimizer, norms: Optional[ShardedNorms]) -> torch.optim.Optimizer:
        """An optimizer the client built learns what the ZeRO layer knows: a Lamb (and 1-bit LAMB) the shards'
        parameter ranges, a stage-0 1-bit optimizer the compressed all-reduce it averages with."""
        if isinstance(built, (Lamb, OneBitLamb)) and built.sharded_norms is None:
            built.sharded_norms = norms
        if isinstance(built, (OneBitLamb, ZeroOneAdam)) and built.all_reduce is None and norms is not None:
            built.all_reduce = norms.compressed  # they average themselves (1-bit Adam's momentum is the stack's)
        return built

    if isinstance(optimizer, torch.optim.Optimizer):
        if cfg.optimizer is not None:
            raise ValueError("both a client optimizer and an 'optimizer' config block were given; drop one")
        check_client_optimizer(optimizer, stage, allow_untested, force_cpu_optimizer)

        def adopt(master_groups: list[dict], norms: Optional[ShardedNorms]) -> torch.optim.Optimizer:
            for target, group in zip(optimizer.param_groups, master_groups):
                target["params"] = group["params"]
            optimizer.state.clear()
            return shard_aware(optimizer, norms)

        return [dict(g) for g in optimizer.param_groups], adopt
    groups = _param_groups(model, model_parameters)
    if optimizer is not None:

        def build_client(master_groups: list[dict], norms: Optional[ShardedNorms]) -> torch.optim.Optimizer:
            built = optimizer(master_groups)
            check_client_optimizer(built, stage, allow_untested, force_cpu_optimizer)
            return shard_aware(built, norms)

        return groups, build_client

    if cfg.optimizer is not None and cfg.optimizer.type.lower() == "muon":  # Muon's matrices, AdamW's the rest
        groups = muon_param_groups(model.named_parameters(), groups, cfg.optimizer.params)

    def build_configured(master_groups: list[dict], norms: Optional[ShardedNorms]) -> torch.optim.Optimizer:
        return build_optimizer(
            cfg.optimizer.type,
            cfg.optimizer.params,
            master_groups,
            zero_stage=stage,
            allow_untested=allow_untested,
            sharded_norms=norms,
        )

    return groups, build_configured


AXIS_KEYS = {"tp": ("tensor", "tensor_parallel.autotp_size"), "ep": ("expert", "expert_parallel.autoep_size")}


def elementwise_only(make_optimizer: MakeOptimizer, model, pieces: Mapping) -> MakeOptimizer:
    """Under tensor or expert parallelism each rank holds a piece of every split tensor (``pieces``: parameter ->
    its split): an optimizer that needs the whole parameter would act on the piece and drift from one process without
    a word (Muon at TP=2: 4.7% off torch.optim.Muon). Lamb completes its per-parameter norms over the tensor group
    (``ShardedNorms``) and trains as one process does; Muon's orthogonalization and 1-bit LAMB are refused by name
    until they gather the pieces. Under expert parallelism Lamb (whose trust ratio would see this rank's experts of
    a fused tensor) and the 1-bit optimizers (whose compressed exchange averages over all ranks) are refused too."""
    axes = {split.axis: split.parts for split in pieces.values()}

    def make(master_groups: list[dict], norms: Optional[ShardedNorms]) -> torch.optim.Optimizer:
        built = make_optimizer(master_groups, norms)
        whole = isinstance(built, WHOLE_PARAMETER_OPTIMIZERS) and not isinstance(built, Lamb)
        if "ep" in axes and isinstance(built, (Lamb, OneBitOptimizer)):
            axis = "ep"
        elif whole:
            axis = next(iter(axes))
        else:
            return built
        split = [name for name, p in model.named_parameters() if pieces.get(p) and pieces[p].axis == axis][:3]
        what, key = AXIS_KEYS[axis]
        raise NotImplementedError(
            f"optimizer {type(built).__name__} with {what} parallelism ({key} {axes[axis]}): it updates each "
            f"parameter from the whole tensor (or averages over every rank), and each rank holds a piece of {split} "
            f"...; not implemented yet: use AdamW (or another elementwise optimizer), or train without {what} "
            "parallelism"
        )

    return make


__all__ = ["OptimizerArg", "elementwise_only", "optimizer_recipe"]
