"""Which parameters share a flat group, per ZeRO stage, and building the flat groups (pure planning apart
from the one step that allocates them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from .. import comm
from ..comm.compression import INT4, INT8, Codec
from ..offload.param_store import QuantizedShard
from ..partition import FlatLayout, assign_buckets, flat_layout
from .buffers import ReusableBuffers
from .flat_group import FlatGroup
from .sharded_param import ParamRecords


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


def plan_flat_groups(
    param_groups: list[dict],
    policy: StagePolicy,
    bucket_size: int,
    units: Optional[list[list[torch.nn.Parameter]]] = None,
    persistent: frozenset = frozenset(),
) -> list[FlatGroupPlan]:
    """Which parameters share a flat group, in the order their gradients are expected.

    Stages 0-2: buckets of ``bucket_size`` elements per parameter group, last parameter first
    (backward produces gradients roughly in reverse). Stage 3: one flat group per gather unit and
    parameter group, units in reverse forward order, then one resident group per parameter group
    for the persistent (small, always gathered) parameters.
    """
    trainable = [[p for p in g["params"] if p.requires_grad] for g in param_groups]
    plans = []
    if not policy.partition_params:
        for index, params in enumerate(trainable):
            params = params[::-1]
            numels = [p.numel() for p in params]
            plans += [
                FlatGroupPlan(index, [params[i] for i in bucket], True)
                for bucket in assign_buckets(numels, bucket_size)
            ]
        return plans
    group_of = {p: i for i, params in enumerate(trainable) for p in params}
    for unit in reversed(units or []):
        for index in range(len(param_groups)):
            members = [p for p in unit if group_of.get(p) == index and p not in persistent]
            if members:
                plans.append(FlatGroupPlan(index, members, False))
    for index, params in enumerate(trainable):
        members = [p for p in params if p in persistent]
        if members:
            plans.append(FlatGroupPlan(index, members, True))
    return plans


def plan_frozen_groups(
    units: list[list[torch.nn.Parameter]], persistent: frozenset = frozenset()
) -> list[FlatGroupPlan]:
    """Stage 3: one flat group per gather unit for its parameters without gradients (a fine-tune's frozen base),
    sharded and gathered with the unit like the trainable ones, with no optimizer state and no gradient bucket.
    ``group_index`` is -1: no optimizer parameter group holds them."""
    plans = []
    for unit in reversed(units):
        members = [p for p in unit if not p.requires_grad and p not in persistent]
        if members:
            plans.append(FlatGroupPlan(-1, members, False))
    return plans


def plan_layouts(
    plans: list[FlatGroupPlan], param_names: dict[torch.nn.Parameter, str], shard_count: int
) -> list[FlatLayout]:
    """Each planned flat group's layout, cut into ``shard_count`` shards (1 under stage 0)."""
    return [
        flat_layout([param_names[p] for p in plan.params], [tuple(p.shape) for p in plan.params], shard_count)
        for plan in plans
    ]


def build_flat_groups(
    plans: list[FlatGroupPlan],
    layouts: list[FlatLayout],
    shard_group: comm.Group,
    compute_dtype: torch.dtype,
    device: torch.device,
    records: ParamRecords,
    buffers: ReusableBuffers,
    shard_home: Optional[Callable[[torch.Tensor], Any]] = None,
    materialize: Optional[Callable[[list[torch.nn.Parameter]], None]] = None,
    quantized: QuantizedComm = QuantizedComm(),
) -> list[FlatGroup]:
    """One flat group per plan over ``shard_group``. ``materialize`` (zero.Init) gives each group's parameters
    data just before the group is built, so a rank never holds more than one group's whole parameters besides
    its shards."""
    flats = []
    for plan, layout in zip(plans, layouts):
        if materialize is not None:
            materialize(plan.params)
        home = (lambda values: QuantizedShard(values, INT8)) if quantized.keeps_int8(plan) else shard_home
        flats.append(
            FlatGroup(
                layout,
                plan.params,
                compute_dtype,
                shard_group,
                device,
                records,
                buffers,
                plan.resident,
                home,
                quantized.gather_codec(plan),
            )
        )
    return flats
