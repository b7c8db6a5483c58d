"""The ZeRO stack: every object that holds a rank's model state for one engine, built in one place.

:func:`build_zero_stack` plans and allocates, in order, the gather units (stage 3), the flat groups, the optimizer
state in its home, one gradient bucket per flat group, the stage-3 runtime and the gradient reducer (wired to the
stage-3 runtime here, so nothing outside ``zero/`` completes an object after construction). The
:class:`ZeroStack` it returns is what the engine drives: ``begin_backward`` / ``end_backward`` around the user's
backward, ``step``, ``zero_grad``, and the bytes held, counted from the owners' tensors. An engine without an
optimizer holds a stack with no flat groups (:meth:`ZeroStack.without_optimizer`), whose training calls say what is
missing.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping, Optional

import torch

from .. import comm
from ..accelerator import get_accelerator
from ..comm.compression import Codec
from ..log import log_rank0
from ..offload import OffloadDevice, OffloadPlan, ShardHomes, shard_homes
from ..precision import LossScaler, PrecisionPolicy
from .buffers import ReusableBuffers
from .flat_group import FlatGroup
from .gradient_check import GradientCheck
from .optimizer import NormAxes, ZeroOptimizer
from .optimizer_state import MakeOptimizer, build_optimizer_state
from .param_access import ParamAccess
from .planning import ModelPlan, QuantizedComm, StagePolicy, build_flat_groups, plan_model
from .reducer import GradBucket, GradientReducer
from .sharded_param import ParamRecords
from .stage3 import Stage3Runtime, build_units
from .state_offload import COMPUTE, TRAINING

ROLES = (
    "params",
    "gathered",
    "master",
    "grad_shard",
    "staging",
    "idle_buffers",
    "optimizer_state",
    "compression_error",
)
NO_OPTIMIZER = "needs an optimizer: pass optimizer= or add an 'optimizer' config block"


@dataclass(frozen=True)
class Placement:
    """Where the training state lives: precision, compute device, offload homes."""

    policy: PrecisionPolicy
    device: torch.device
    offload: OffloadPlan


class ZeroStack:
    """One engine's ZeRO state and the calls that drive it (see the module docstring)."""

    def __init__(
        self,
        *,
        records: ParamRecords,
        buffers: ReusableBuffers,
        reducer: Optional[GradientReducer],
        optimizer: Optional[ZeroOptimizer],
        stage3: Optional[Stage3Runtime],
        shard_homes: Optional[ShardHomes] = None,
        access: Optional[ParamAccess] = None,
    ):
        self.records = records  # what is known of each (stage-3) parameter
        self.buffers = buffers  # gathered units and gradient staging, reused step after step
        self.reducer = reducer
        self.optimizer = optimizer  # the step's arithmetic (DeepSpeed's engine.optimizer)
        self.stage3 = stage3
        self.shard_homes = shard_homes  # offload_param: where stage-3 shards live, and their staging pool
        self.access = access  # one parameter's master weights, gradient and optimizer state

    @classmethod
    def without_optimizer(cls, device: torch.device) -> "ZeroStack":
        """An engine built without an optimizer (evaluation, ``init_inference``-like use): nothing is sharded."""
        return cls(
            records=ParamRecords(),
            buffers=ReusableBuffers(device),
            reducer=None,
            optimizer=None,
            stage3=None,
        )

    def refuse_if_offloaded(self, call: str, weights_only: bool = False) -> None:
        """Refuse ``call`` by name while a state it needs is on the host (``weights_only``: it reads the compute
        parameters and nothing else, as a forward does)."""
        if self.optimizer is not None:
            self.optimizer.states.refuse_use(f"engine.{call}", COMPUTE if weights_only else TRAINING)

    def needs_optimizer(self, call: str) -> ZeroOptimizer:
        if self.optimizer is None:
            raise RuntimeError(f"engine.{call} {NO_OPTIMIZER}")
        return self.optimizer

    # -- one training step -------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self.optimizer.loss_scaler.scale if self.optimizer is not None else 1.0

    def begin_backward(self, boundary: bool, scaled_loss: torch.Tensor) -> None:
        """Before the user's backward: whether it ends an accumulation, and the loss autograd starts from."""
        self.needs_optimizer("backward")
        self.reducer.begin_backward(boundary, scaled_loss)

    def end_backward(self, graph_retained: bool = False) -> None:
        """After it: the remaining reductions are launched and finished, then (stage 3) what is still gathered is
        freed (the hooks on this forward's outputs stay only when the graph is kept for another backward)."""
        self.reducer.end_backward()
        if self.stage3 is not None:
            self.stage3.end_backward(graph_retained=graph_retained)

    def step(self) -> bool:
        """The optimizer step; False when an fp16 overflow skipped it."""
        return self.needs_optimizer("step").step()

    def zero_grad(self, module: torch.nn.Module) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad()
        else:
            module.zero_grad(set_to_none=True)

    def learning_rates(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups] if self.optimizer is not None else []

    @property
    def global_grad_norm(self) -> Optional[float]:
        return self.optimizer.global_grad_norm if self.optimizer is not None else None

    def take_gather_seconds(self) -> float:
        """Time spent gathering stage-3 units since the last call (0 without stage 3)."""
        return self.stage3.take_gather_seconds() if self.stage3 is not None else 0.0

    def destroy(self) -> None:
        """Finish the reductions in flight and remove the gradient and stage-3 module hooks."""
        if self.reducer is not None:
            self.reducer.destroy()
        if self.stage3 is not None:
            self.stage3.destroy()

    # -- what it holds ------------------------------------------------------------------------
    @property
    def flat_groups(self) -> list[FlatGroup]:
        """The trainable flat groups, in reduction order (the optimizer steps them)."""
        return self.optimizer.flat_groups if self.optimizer is not None else []

    @property
    def frozen_groups(self) -> list[FlatGroup]:
        """Stage 3: the flat groups of sharded parameters without gradients."""
        return self.optimizer.frozen_groups if self.optimizer is not None else []

    @property
    def all_flat_groups(self) -> list[FlatGroup]:
        return [*self.flat_groups, *self.frozen_groups]

    def state_bytes_by_location(self) -> dict[str, dict[str, int]]:
        """Bytes of model state this rank holds per location (``device``, ``host``, ``nvme``) and role, counted
        from the owners' tensors (and swap-file regions)."""
        totals = {where: dict.fromkeys(ROLES, 0) for where in ("device", "host", "nvme")}
        if self.optimizer is None:
            return totals
        state = self.optimizer.optimizer_state
        parts = [flat.bytes_held() for flat in self.all_flat_groups]
        parts.append(self.reducer.bytes_held(state.location))
        parts.append(state.bytes_held())
        parts.append({"compression_error": {"device": self.optimizer.compression_bytes()}})
        if self.shard_homes is not None:
            parts.append(self.shard_homes.bytes_held())
        for part in parts:
            for role, places in part.items():
                for where, nbytes in places.items():
                    totals[where][role] += nbytes
        totals["device"]["idle_buffers"] += self.buffers.idle_bytes  # reusable, not in use between steps
        return totals

    def state_bytes(self) -> dict[str, int]:
        """Bytes of model state this rank holds per role, wherever it lives."""
        by_location = self.state_bytes_by_location()
        return {role: sum(places[role] for places in by_location.values()) for role in ROLES}


def _module_paths(model: torch.nn.Module, modules) -> tuple[str, ...]:
    """Paths in ``model`` of ``modules`` (module objects, or paths as given)."""
    paths = {id(module): path for path, module in model.named_modules()}
    for module in modules:
        if not isinstance(module, str) and id(module) not in paths:
            raise ValueError(f"leaf module {type(module).__name__} is not a module of the model being initialized")
    return tuple(m if isinstance(m, str) else paths[id(m)] for m in modules)


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
) -> ZeroStack:
    """Plan and build the stack for ``model``'s ``param_groups`` (each ``{"params": [...], ...}``) under ``config``
    (the resolved ``ZeroshardConfig``); ``make_optimizer`` builds the torch optimizer over the master shards.
    ``tensor_splits`` maps the parameters split over the mesh's tensor-parallel group to how they are cut (each
    flat group's slots carry it): ZeRO runs inside the gradient group, on each rank's pieces."""
    z = config.zero_optimization
    classes = frozenset(c if isinstance(c, str) else c.__name__ for c in gather_unit_classes or ())
    # stage 0 reduces over the whole data-parallel group; sharded stages over the shard group inside it
    stage = StagePolicy.for_stage(z.stage)
    shard_group = mesh.shard if stage.partition_optimizer else mesh.gradient
    leaves = _module_paths(model, leaf_modules)
    plan = plan_model(model, param_groups, z, shard_group.size, classes, leaves, tensor_splits)
    if stage.partition_params:
        _log_units(plan)
    records = ParamRecords()
    buffers = ReusableBuffers(placement.device)
    largest = max((layout.shard_numel for layout in plan.layouts), default=1)
    homes = shard_homes(placement.offload, placement.policy.compute, largest)
    every = build_flat_groups(
        plan.flat_groups,
        plan.layouts,
        shard_group,
        placement.policy.compute,
        placement.device,
        records,
        buffers,
        homes.place if homes is not None else None,
        materialize,
        QuantizedComm.from_config(z),
    )
    flats, frozen = every[: len(plan.trainable)], every[len(plan.trainable) :]
    state = build_optimizer_state(
        flats,
        [flat_plan.group_index for flat_plan in plan.trainable],
        param_groups,
        make_optimizer,
        placement.policy.master,
        placement.offload,
        get_accelerator().synchronize,
    )
    for flat in flats:
        records.own(flat, state)
    for flat in frozen:
        records.own(flat, None)  # its compute-precision shard is its only copy
    codec = QuantizedComm.from_config(z).gradient_codec
    buckets = _gradient_buckets(flats, mesh, placement, state.device, stage, buffers, codec)
    stage3 = _stage3_runtime(model, plan, buckets, frozen, buffers, z, placement.offload) if plan.units else None
    reducer = _reducer(model, buckets, mesh, stage, config, stage3)
    optimizer = ZeroOptimizer(
        flats,
        state,
        reducer,
        LossScaler.from_config(config.fp16),
        frozen_groups=frozen,
        norm=NormAxes(shard=mesh.shard if stage.partition_optimizer else None, tensor=mesh.tensor),
        gradient_clipping=config.gradient_clipping,
        max_consecutive_skipped_steps=config.max_consecutive_skipped_steps,
        buffers=buffers,
    )
    return ZeroStack(
        records=records,
        buffers=buffers,
        reducer=reducer,
        optimizer=optimizer,
        stage3=stage3,
        shard_homes=homes,
        access=ParamAccess(records, state, reducer, optimizer.states),
    )


def _reducer(model, buckets, mesh: comm.Mesh, stage: StagePolicy, config, stage3) -> GradientReducer:
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
        check=_gradient_check(buckets, names, mesh, config),
    )


def _gradient_check(buckets, names: dict, mesh: comm.Mesh, config) -> Optional[GradientCheck]:
    """The ``gradient_check`` block's check, or None (off, the default)."""
    settings = config.gradient_check
    if not settings.enabled:
        return None
    if any(bucket.codec is not None for bucket in buckets):
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
    )


def _stage3_runtime(model, plan: ModelPlan, buckets, frozen, buffers, z, offload: OffloadPlan) -> Stage3Runtime:
    """The hooks that gather and free the gather units, over their flat groups and gradient buckets."""
    root_unit, units = build_units(plan.units, buckets, frozen)
    return Stage3Runtime(
        model,
        root_unit,
        units,
        buffers,
        z.prefetch_bucket_size,
        z.max_live_parameters,
        fetch_ahead=offload.param_buffer_count - 1 if offload.param_device is OffloadDevice.NVME else 0,
        prefetch_depth=z.prefetch_depth,
    )


def _log_units(plan: ModelPlan) -> None:
    names = [u.name or "<root>" for u in plan.units]
    log_rank0(
        f"stage 3: {len(names)} gather units ({', '.join(names[:6])}{', ...' if len(names) > 6 else ''}), "
        f"{len(plan.persistent)} persistent parameters"
    )


def _gradient_buckets(
    flats: list[FlatGroup],
    mesh: comm.Mesh,
    placement: Placement,
    grad_device: torch.device,
    stage: StagePolicy,
    buffers: ReusableBuffers,
    codec: Optional[Codec] = None,
) -> list[GradBucket]:
    """One bucket per flat group; its gradient shard lives where the optimizer state steps it; ``codec``
    (``zero_quantized_gradients``) quantizes its reduce-scatter."""
    # hybrid sharding: the shard groups' results are summed across replica groups (stage 0 reduced over all)
    one = comm.Group("replica", (comm.get_rank(),), None, mesh.context)
    replica = mesh.replica if stage.partition_optimizer else one
    policy, offload = placement.policy, placement.offload
    pin = offload.pin_memory and offload.offloads_optimizer
    return [
        GradBucket(
            flat=flat,
            reduce_dtype=policy.reduce,
            grad_dtype=policy.grad,
            replica_group=replica,
            grad_device=grad_device,
            buffers=buffers,
            pin_memory=pin,
            codec=codec,
        )
        for flat in flats
    ]
