"""Which parameters share a flat group, per ZeRO stage, and building the flat groups (pure planning apart
from the one step that allocates them)."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping, Optional

import torch

from .. import comm
from ..comm.compression import INT4, INT8, Codec
from ..offload import ShardHome
from ..offload.param_store import QuantizedShard
from ..partition import FlatLayout, assign_buckets, flat_layout
from .buffers import ReusableBuffers
from .flat_group import FlatGroup
from .sharded_param import ParamRecords
from .stage3.units import UnitPlan, granularity_leaf_paths, leaf_module_paths, plan_units


@dataclass(frozen=True)
class StagePolicy:
    partition_optimizer: bool  # stages >= 1: master weights and optimizer state sharded
    reduce_every_micro_step: bool  # stages 2, 3: gradients reduced (and freed) during every backward
    partition_params: bool  # stage 3: compute parameters sharded, gathered per unit around its use

    @classmethod
    def for_stage(cls, stage: int) -> "StagePolicy":
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_optimization.stage must be 0-3, got {stage}")
        return cls(partition_optimizer=stage >= 1, reduce_every_micro_step=stage >= 2, partition_params=stage == 3)


@dataclass(frozen=True)
class QuantizedComm:
    """ZeRO++ (stage 3): which collectives send block-quantized messages (``zeroshard.comm.compression``)."""

    weights: bool = False  # qwZ (zero_quantized_weights): every gathered flat group sent as int8
    nontrainable_weights: bool = False  # frozen flat groups kept as int8 and sent as int8
    gradients: bool = False  # qgZ (zero_quantized_gradients): gradients reduce-scattered as int4

    @classmethod
    def from_config(cls, zero) -> "QuantizedComm":
        return cls(zero.zero_quantized_weights, zero.zero_quantized_nontrainable_weights, zero.zero_quantized_gradients)

    def keeps_int8(self, plan: "FlatGroupPlan") -> bool:
        return self.nontrainable_weights and not plan.resident and plan.group_index < 0

    def gather_codec(self, plan: "FlatGroupPlan") -> Optional[Codec]:
        if plan.resident:  # persistent parameters are gathered once, after the step, exactly
            return None
        return INT8 if self.weights or self.keeps_int8(plan) else None

    @property
    def gradient_codec(self) -> Optional[Codec]:
        return INT4 if self.gradients else None


@dataclass(frozen=True)
class FlatGroupPlan:
    group_index: int  # optimizer parameter group
    params: list  # in flat order
    resident: bool
    # the dtype its buffer holds: None for the compute dtype; packed quantized parameters keep their storage dtype
    dtype: Optional[torch.dtype] = None


SPLIT_AXES = (None, "tp", "ep")  # replicated, tensor-parallel pieces, experts


def axis_of(param, tensor_splits: Mapping) -> Optional[str]:
    split = tensor_splits.get(param)
    return None if split is None else split.axis


def by_split_axis(params: list, tensor_splits: Mapping, tied: Mapping = MappingProxyType({})) -> list[list]:
    """``params`` as runs that are all replicated (identical on every rank of the tensor and expert groups) or all
    pieces split over one axis (``tensor_splits``: parameter -> its split; ``tp`` tensor-parallel pieces, ``ep`` this
    rank's experts), replicated ones first, each in the given order; empty runs are dropped. A flat group is one run,
    so the gradient norm counts each element once and expert groups shard over their own ranks. Parameters a pipeline
    stage shares with others (``tied``: parameter -> the tie's group) come last, one run per tie: every stage holding
    a tie lays its flat group out alike, so their reduced gradient shards add up element by element. Without tensor,
    expert or pipeline parallelism this is ``[params]``."""
    untied = [p for p in params if p not in tied]
    runs = [[p for p in untied if axis_of(p, tensor_splits) == axis] for axis in SPLIT_AXES]
    ties = sorted({tied[p].name for p in params if p in tied})
    runs += [[p for p in params if p in tied and tied[p].name == name] for name in ties]
    return [members for members in runs if members]


def is_packed(param: torch.nn.Parameter) -> bool:
    """A parameter whose data is packed quantized storage with its quantization state beside it (bitsandbytes'
    ``Params4bit``: QLoRA's frozen 4-bit base weights, stored as bytes in ``bnb_4bit_quant_storage``). Its bytes are
    meaningful only as they are: it is sharded, gathered and moved bit for bit, never cast, reduced or stepped."""
    return type(param) is not torch.nn.Parameter and getattr(param, "quant_state", None) is not None


def plan_flat_groups(
    param_groups: list[dict],
    policy: StagePolicy,
    bucket_size: int,
    units: Optional[list[list[torch.nn.Parameter]]] = None,
    persistent: frozenset = frozenset(),
    tensor_splits: Mapping = MappingProxyType({}),
    tied: Mapping = MappingProxyType({}),
) -> list[FlatGroupPlan]:
    """Which parameters share a flat group, in the order their gradients are expected.

    Stages 0-2: buckets of ``bucket_size`` elements per parameter group, last parameter first
    (backward produces gradients roughly in reverse). Stage 3: one flat group per gather unit and
    parameter group, units in reverse forward order, then one resident group per parameter group
    for the persistent (small, always gathered) parameters. Pieces of split parameters (``tensor_splits``:
    tensor-parallel pieces, experts) and the replicated ones never share a flat group.
    """
    trainable = [[p for p in g["params"] if p.requires_grad] for g in param_groups]
    plans = []
    if not policy.partition_params:
        for index, params in enumerate(trainable):
            for run in by_split_axis(params[::-1], tensor_splits, tied):
                numels = [p.numel() for p in run]
                plans += [
                    FlatGroupPlan(index, [run[i] for i in bucket], True)
                    for bucket in assign_buckets(numels, bucket_size)
                ]
        return plans
    group_of = {p: i for i, params in enumerate(trainable) for p in params}
    for unit in reversed(units or []):
        for index in range(len(param_groups)):
            members = [p for p in unit if group_of.get(p) == index and p not in persistent]
            for run in by_split_axis(members, tensor_splits, tied):
                plans.append(FlatGroupPlan(index, run, False))
    for index, params in enumerate(trainable):
        members = [p for p in params if p in persistent]
        for run in by_split_axis(members, tensor_splits, tied):
            plans.append(FlatGroupPlan(index, run, True))
    return plans


def plan_frozen_groups(
    units: list[list[torch.nn.Parameter]],
    persistent: frozenset = frozenset(),
    tensor_splits: Mapping = MappingProxyType({}),
    tied: Mapping = MappingProxyType({}),
) -> list[FlatGroupPlan]:
    """Stage 3: one flat group per gather unit for its parameters without gradients (a fine-tune's frozen base),
    sharded and gathered with the unit like the trainable ones, with no optimizer state and no gradient bucket.
    ``group_index`` is -1: no optimizer parameter group holds them."""
    plans = []
    for unit in reversed(units):
        members = [p for p in unit if not p.requires_grad and p not in persistent]
        plain = [p for p in members if not is_packed(p)]
        for run in by_split_axis(plain, tensor_splits):
            plans.append(FlatGroupPlan(-1, run, False))
        packed = [p for p in members if is_packed(p)]
        for dtype in dict.fromkeys(p.dtype for p in packed):  # one group per storage dtype, in parameter order
            plans.append(FlatGroupPlan(-1, [p for p in packed if p.dtype == dtype], False, dtype))
    return plans


def plan_layouts(
    plans: list[FlatGroupPlan],
    param_names: dict[torch.nn.Parameter, str],
    shard_count: int,
    tensor_splits: Mapping = MappingProxyType({}),
    expert_shard_count: Optional[int] = None,
) -> list[FlatLayout]:
    """Each planned flat group's layout, cut into ``shard_count`` shards (1 under stage 0), or, for a group of
    experts, ``expert_shard_count`` (the ranks holding the same experts); each slot carries its parameter's split,
    recorded here once."""
    return [
        flat_layout(
            [param_names[p] for p in plan.params],
            [tuple(p.shape) for p in plan.params],
            expert_shard_count or shard_count if axis_of(plan.params[0], tensor_splits) == "ep" else shard_count,
            splits=[tensor_splits.get(p) for p in plan.params],
        )
        for plan in plans
    ]


@dataclass(frozen=True)
class ModelPlan:
    """Everything decided about one model before anything is allocated: the stage's policy, the gather units
    (stage 3), the parameters that stay gathered, the flat groups (trainable ones in reduction order, then stage 3's
    frozen ones) and their layouts. The engine allocates from it; ``zeroshard.estimate`` counts bytes from it."""

    stage: StagePolicy
    units: list[UnitPlan]  # stage 3: the gather units, the root first; [] below stage 3
    persistent: frozenset  # stage 3: parameters small enough to stay gathered
    trainable: list[FlatGroupPlan]
    frozen: list[FlatGroupPlan]
    layouts: list[FlatLayout]  # trainable, then frozen
    shard_count: int  # shards per flat group: the shard group's size, or 1 at stage 0
    expert_shard_count: int = 1  # shards per flat group of experts: the expert shard group's size, or 1 at stage 0

    @property
    def flat_groups(self) -> list[FlatGroupPlan]:
        return [*self.trainable, *self.frozen]


def leaf_paths_of(model: torch.nn.Module, zero_config, extra: tuple[str, ...] = ()) -> list[str]:
    """Stage 3's leaf modules (each one gather unit): the ``leaf_module`` block's and ``extra`` paths, then those
    ``stage3_module_granularity_threshold`` chooses."""
    leaf = zero_config.leaf_module
    leaves = leaf_module_paths(model, leaf.classes, [*leaf.names, *extra], leaf.name_suffixes)
    return leaves + [
        p for p in granularity_leaf_paths(model, zero_config.module_granularity_threshold) if p not in leaves
    ]


def plan_model(
    model: torch.nn.Module,
    param_groups: list[dict],
    zero_config,
    shard_count: int,
    gather_unit_classes: frozenset = frozenset(),
    leaf_paths: tuple[str, ...] = (),
    tensor_splits: Mapping = MappingProxyType({}),
    expert_shard_count: int = 1,
    tied: Mapping = MappingProxyType({}),
) -> ModelPlan:
    """Plan ``model``'s flat groups for ``param_groups`` under ``zero_config`` (the ``zero_optimization`` block) with
    shard groups of ``shard_count`` ranks; ``gather_unit_classes`` adds to the block's unit classes and
    ``leaf_paths`` to its leaf modules (stage 3); ``tensor_splits`` maps the parameters split over a
    tensor-parallel group (this rank holds a piece) or an expert-parallel group (this rank's experts, sharded over
    the ``expert_shard_count`` ranks holding the same ones, ``comm.Mesh.expert_shard``) to how they are cut; ``tied``
    maps the parameters a pipeline stage shares with other stages to the tie's group (stages 0-1: pipelines)."""
    z = zero_config
    stage = StagePolicy.for_stage(z.stage)
    param_names = {p: name for name, p in model.named_parameters()}
    trained_packed = [name for p, name in param_names.items() if is_packed(p) and p.requires_grad]
    if trained_packed:
        raise ValueError(
            f"parameter '{trained_packed[0]}' is packed quantized storage (bitsandbytes 4-bit) and requires grad: "
            "quantized weights cannot be trained; freeze them and train adapters (peft LoRA) instead"
        )
    unknown = [p for g in param_groups for p in g["params"] if p not in param_names]
    if unknown:
        raise ValueError(
            f"{len(unknown)} optimizer parameter(s) (first shape {tuple(unknown[0].shape)}) "
            "are not parameters of the model"
        )
    unit_plans, persistent = [], frozenset()
    if stage.partition_params:
        classes = frozenset(z.gather_unit_classes) | gather_unit_classes
        unit_plans = plan_units(model, classes, z.gather_unit_min_params, tuple(leaf_paths_of(model, z, leaf_paths)))
        # a frozen piece of a split parameter (a fine-tune's tensor-parallel or expert base) is sharded however small:
        # kept whole outside the flat groups it could not be saved and resumed at another degree
        persistent = frozenset(
            p
            for p in model.parameters()
            if p.numel() < z.param_persistence_threshold and (p.requires_grad or p not in tensor_splits)
        )
    units = [u.params for u in unit_plans]
    trainable = plan_flat_groups(param_groups, stage, z.reduce_bucket_size, units, persistent, tensor_splits, tied)
    frozen = plan_frozen_groups(units, persistent, tensor_splits) if stage.partition_params else []
    count = shard_count if stage.partition_optimizer else 1
    experts = expert_shard_count if stage.partition_optimizer else 1
    layouts = plan_layouts([*trainable, *frozen], param_names, count, tensor_splits, experts)
    return ModelPlan(stage, unit_plans, persistent, trainable, frozen, layouts, count, experts)


def build_flat_groups(
    *,
    plans: list[FlatGroupPlan],
    layouts: list[FlatLayout],
    shard_group: comm.Group,
    compute_dtype: torch.dtype,
    device: torch.device,
    records: ParamRecords,
    buffers: ReusableBuffers,
    shard_home: Optional[Callable[[torch.Tensor], ShardHome]] = None,
    materialize: Optional[Callable[[list[torch.nn.Parameter]], None]] = None,
    quantized: QuantizedComm = QuantizedComm(),
    expert_shard_group: Optional[comm.Group] = None,
) -> list[FlatGroup]:
    """One flat group per plan over ``shard_group`` (a group of experts over ``expert_shard_group``).
    ``materialize`` (zero.Init) gives each group's parameters data just before the group is built, so a rank never
    holds more than one group's whole parameters besides its shards."""
    flats = []
    for plan, layout in zip(plans, layouts):
        if materialize is not None:
            materialize(plan.params)
        home = (lambda values: QuantizedShard(values, INT8)) if quantized.keeps_int8(plan) else shard_home
        flats.append(
            FlatGroup(
                layout=layout,
                params=plan.params,
                compute_dtype=plan.dtype or compute_dtype,
                shard_group=expert_shard_group if layout.split_axis == "ep" else shard_group,
                device=device,
                records=records,
                buffers=buffers,
                resident=plan.resident,
                shard_home=home,
                gather_codec=quantized.gather_codec(plan),
            )
        )
    return flats
