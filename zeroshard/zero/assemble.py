"""Building the ZeRO stack: every object that holds a rank's model state for one engine, built in one place.

:func:`build_zero_stack` plans and allocates, in order, the gather units (stage 3), the flat groups, the optimizer
state in its home, one gradient bucket per flat group, the stage-3 runtime, the gradient reducer (wired to the
stage-3 runtime here, so nothing outside ``zero/`` completes an object after construction) and the gradient
exchange the optimizer names, and hands them to the :class:`~zeroshard.zero.stack.ZeroStack` that owns them.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping, Optional

import torch

from .. import comm
from ..accelerator import get_accelerator
from ..log import log_rank0
from ..offload import OffloadDevice, OffloadPlan, shard_homes
from ..precision import LossScaler, PrecisionPolicy
from .buffers import ReusableBuffers
from .exchange import exchange_for
from .flat_group import FlatGroup
from .grad_norm import NormAxes
from .gradient_check import GradientCheck
from .optimizer_home import build_optimizer_state
from .optimizer_state import MakeOptimizer, OptimizerState
from .planning import ModelPlan, QuantizedComm, StagePolicy, build_flat_groups, plan_model
from .reducer import GradBucket, GradientReducer
from .sharded_param import ParamRecords
from .stack import StepSettings, ZeroStack
from .stage3 import Stage3Runtime, build_units


@dataclass(frozen=True)
class Placement:
    """Where the training state lives: precision, compute device, offload homes."""

    policy: PrecisionPolicy
    device: torch.device
    offload: OffloadPlan


def _module_paths(model: torch.nn.Module, modules) -> tuple[str, ...]:
    """Paths in ``model`` of ``modules`` (module objects, or paths as given)."""
    paths = {id(module): path for path, module in model.named_modules()}
    for module in modules:
        if not isinstance(module, str) and id(module) not in paths:
            raise ValueError(f"leaf module {type(module).__name__} is not a module of the model being initialized")
    return tuple(m if isinstance(m, str) else paths[id(m)] for m in modules)


def _plan(model, param_groups, z, *, shard_group, gather_unit_classes, leaf_modules, tensor_splits, expert_shards: int,
          tied):  # fmt: skip
    """The model's flat groups and gather units (:func:`.planning.plan_model`) from the config's and the caller's
    unit classes and leaf modules (stage 3 logs its units)."""
    classes = frozenset(c if isinstance(c, str) else c.__name__ for c in gather_unit_classes or ())
    leaves = _module_paths(model, leaf_modules)
    plan = plan_model(model, param_groups, z, shard_group.size, classes, leaves, tensor_splits, expert_shards, tied)
    if plan.stage.partition_params:
        _log_units(plan)
    return plan


def build_zero_stack(
    *,
    model: torch.nn.Module,
    param_groups: list[dict],
    make_optimizer: MakeOptimizer,
    config,
    mesh: comm.Mesh,
    placement: Placement,
    materialize=None,
    gather_unit_classes=None,
    leaf_modules=(),
    tensor_splits: Mapping = MappingProxyType({}),
    tied: Mapping = MappingProxyType({}),
) -> ZeroStack:
    """Plan and build the stack for ``model``'s ``param_groups`` (each ``{"params": [...], ...}``) under ``config``
    (the resolved ``ZeroshardConfig``); ``make_optimizer`` builds the torch optimizer over the master shards.
    ``tensor_splits`` maps the parameters split over the tensor group, and this rank's experts, to how they are cut
    (each flat group's slots carry it): ZeRO runs inside the gradient group, on each rank's pieces; groups of experts
    shard and reduce over the ranks holding them, divided by the whole data-parallel size as every gradient is;
    ``tied``: the parameters pipeline stages share, with the tie's group (``GradientNorm.sum_tied``)."""
    z = config.zero_optimization
    stage, quantized = StagePolicy.for_stage(z.stage), QuantizedComm.from_config(z)
    # stage 0 reduces over the whole data-parallel group; sharded stages over the shard group inside it
    shard_group = mesh.shard if stage.partition_optimizer else mesh.gradient
    plan = _plan(model, param_groups, z, shard_group=shard_group, gather_unit_classes=gather_unit_classes,
                 leaf_modules=leaf_modules, tensor_splits=tensor_splits,
                 expert_shards=mesh.expert_shard.size, tied=tied)  # fmt: skip
    records, buffers = ParamRecords(), ReusableBuffers(placement.device)
    largest = max((layout.shard_numel for layout in plan.layouts), default=1)
    homes = shard_homes(placement.offload, placement.policy.compute, largest)
    every = build_flat_groups(
        plans=plan.flat_groups, layouts=plan.layouts, shard_group=shard_group, compute_dtype=placement.policy.compute,
        device=placement.device, records=records, buffers=buffers, materialize=materialize,
        shard_home=homes.place if homes is not None else None, quantized=quantized,
        expert_shard_group=mesh.expert_shard if stage.partition_optimizer else mesh.expert_gradient,
    )  # fmt: skip
    flats, frozen = every[: len(plan.trainable)], every[len(plan.trainable) :]
    group_of_flat = [flat_plan.group_index for flat_plan in plan.trainable]
    state = build_optimizer_state(
        flats, group_of_flat=group_of_flat, param_groups=param_groups, make_optimizer=make_optimizer,
        master_dtype=placement.policy.master, offload=placement.offload, synchronize=get_accelerator().synchronize,
        pieces=mesh.pieces,
    )  # fmt: skip
    stage3, reducer = _gradient_side(model, plan, flats, frozen, state, mesh=mesh, placement=placement, stage=stage,
                                     config=config, buffers=buffers)  # fmt: skip
    return ZeroStack(
        records=records,
        buffers=buffers,
        flat_groups=flats,
        frozen_groups=frozen,
        optimizer_state=state,
        reducer=reducer,
        exchange=exchange_for(state.optimizer, flats, reducer, state.group_of_flat, quantized.gradient_codec),
        loss_scaler=LossScaler.from_config(config.fp16),
        norm=_norm_axes(mesh, stage),
        ties=[tied.get(flat.params[0]) for flat in flats],
        settings=StepSettings(config.gradient_clipping, config.max_consecutive_skipped_steps),
        stage3=stage3,
        shard_homes=homes,
    )


def _gradient_side(model, plan, flats, frozen, state, *, mesh, placement, stage, config, buffers) -> tuple:
    """The gradient buckets (one per flat group), the stage-3 runtime over them (None below stage 3) and the
    reducer whose hooks fill them."""
    z = config.zero_optimization
    buckets = _gradient_buckets(flats, mesh=mesh, placement=placement, state=state, stage=stage, buffers=buffers)
    stage3 = None
    if plan.units:
        stage3 = _stage3_runtime(
            model, plan, buckets=buckets, frozen=frozen, buffers=buffers, z=z, offload=placement.offload
        )
    return stage3, _reducer(model, buckets, mesh, stage, config, stage3, state)


def _norm_axes(mesh: comm.Mesh, stage: StagePolicy) -> NormAxes:
    """The gradient norm's groups: over the shard group (sharded stages), then tensor-parallel pieces over the tensor
    group and, at stage 0 (each rank holds its experts' whole gradients), experts over the expert group; sharded,
    experts whose group spans tensor ranks hold different shards on those too (the tensor group); last, the stages of
    a pipeline over the pipe group."""
    split = {"tp": mesh.tensor} if mesh.tensor.size > 1 else {}
    if mesh.expert.size > 1 and not stage.partition_optimizer:
        split["ep"] = mesh.expert
    elif mesh.dims.splits_over_tensor("ep"):
        split["ep"] = mesh.tensor
    stages = mesh.pipe if mesh.pipe.size > 1 else None
    return NormAxes(shard=mesh.shard if stage.partition_optimizer else None, split=split, stages=stages)


def _reducer(model, buckets, mesh: comm.Mesh, stage: StagePolicy, config, stage3, state) -> GradientReducer:
    """The gradient hooks and reductions; under stage 3 a bucket's completion frees its unit (wired here)."""
    z = config.zero_optimization
    names = {p: name for name, p in model.named_parameters()}
    return GradientReducer(
        buckets,
        names,
        mesh.gradient,
        reduce_every_micro_step=stage.reduce_every_micro_step,
        overlap_comm=z.overlap_comm,
        predivide=config.gradient_predivide_factor,
        ignore_unused_parameters=z.ignore_unused_parameters,
        on_bucket_complete=stage3.on_flat_group_complete if stage3 is not None else None,
        on_gradient_final=state.gradient_final,
        check=_gradient_check(buckets, names, mesh, config),
    )


def _gradient_check(buckets, names: dict, mesh: comm.Mesh, config) -> Optional[GradientCheck]:
    """The ``gradient_check`` block's check, or None (off, the default)."""
    settings = config.gradient_check
    if not settings.enabled:
        return None
    if config.zero_optimization.zero_quantized_gradients:
        raise NotImplementedError(
            "gradient_check with zero_optimization.zero_quantized_gradients: the quantized reduce-scatter is not "
            "exact, and the check cannot tell its rounding from a lost gradient; use one or the other"
        )
    return GradientCheck(
        buckets,
        mesh.gradient,
        mesh.world,
        [[names[p] for p in bucket.flat.params] for bucket in buckets],
        interval=settings.interval,
        projections=settings.projections,
        seed=settings.seed,
        expert_group=mesh.expert_gradient if mesh.expert.size > 1 else None,
    )


def _stage3_runtime(model, plan: ModelPlan, *, buckets, frozen, buffers, z, offload: OffloadPlan) -> Stage3Runtime:
    """The hooks that gather and free the gather units, over their flat groups and gradient buckets."""
    root_unit, units = build_units(plan.units, buckets, frozen)
    return Stage3Runtime(
        model,
        root_unit=root_unit,
        units=units,
        buffers=buffers,
        prefetch_numel=z.prefetch_bucket_size,
        max_live_numel=z.max_live_parameters,
        fetch_ahead=offload.param_buffer_count - 1 if offload.param_device is OffloadDevice.NVME else 0,
        prefetch_depth=z.prefetch_depth,
        max_reuse_distance=z.max_reuse_distance,
    )


def _log_units(plan: ModelPlan) -> None:
    names = [u.name or "<root>" for u in plan.units]
    log_rank0(
        f"stage 3: {len(names)} gather units ({', '.join(names[:6])}{', ...' if len(names) > 6 else ''}), "
        f"{len(plan.persistent)} persistent parameters"
    )


def _gradient_buckets(
    flats: list[FlatGroup],
    *,
    mesh: comm.Mesh,
    placement: Placement,
    state: OptimizerState,
    stage: StagePolicy,
    buffers: ReusableBuffers,
) -> list[GradBucket]:
    """One bucket per flat group; its gradient shard waits where the optimizer state says (``grad_home``)."""
    # hybrid sharding: the shard groups' results are summed across replica groups (stage 0 reduced over all)
    replica = mesh.replica if stage.partition_optimizer else None
    policy, offload = placement.policy, placement.offload
    pin = offload.pin_memory and offload.offloads_optimizer
    return [
        GradBucket(
            flat=flat,
            reduce_dtype=policy.reduce,
            home=state.grad_home(index, policy.grad, pin, buffers),
            replica_group=replica,
            buffers=buffers,
        )
        for index, flat in enumerate(flats)
    ]
