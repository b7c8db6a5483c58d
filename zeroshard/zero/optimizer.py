"""The ZeRO optimizer for stages 0, 1 and 2: flat groups, gradient reduction, clipping, loss scaling.

The stages differ only in two policy bits (see ``StagePolicy``); the mechanism is shared:

- stage 0: one shard per flat group (everything replicated); gradients all-reduced once per
  optimizer step.
- stage 1: master weights and optimizer state sharded; gradients accumulate in ``param.grad``
  across micro-batches and are reduce-scattered once at the accumulation boundary.
- stage 2: also gradients sharded: each micro-batch's gradients are reduce-scattered bucket by
  bucket as backward produces them and ``param.grad`` is freed at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .. import comm
from ..optim import Lamb
from ..optim.lamb import ShardedNorms
from ..partition import assign_buckets, flat_layout
from ..precision import LossScaler, PrecisionPolicy
from . import gathered
from .flat_group import FlatGroup


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


class ZeroOptimizer:
    """Owns the flat groups of every optimizer parameter group and drives one optimizer over their shards."""

    def __init__(
        self,
        param_groups: list[dict],
        param_names: dict[torch.nn.Parameter, str],
        make_optimizer: Callable[[list[dict]], torch.optim.Optimizer],
        *,
        stage: int,
        grid: comm.RankGrid,
        policy: PrecisionPolicy,
        loss_scaler: LossScaler,
        bucket_size: int,
        overlap_comm: bool,
        gradient_clipping: float,
        gradient_predivide_factor: float = 1.0,
        device: torch.device,
        units: Optional[list[list[torch.nn.Parameter]]] = None,
        persistent: frozenset = frozenset(),
        materialize: Optional[Callable[[list[torch.nn.Parameter]], None]] = None,
    ):
        self.stage = stage
        self.stage_policy = StagePolicy.for_stage(stage)
        self.grid = grid
        self.policy = policy
        self.loss_scaler = loss_scaler
        self.overlap_comm = overlap_comm
        self.gradient_clipping = gradient_clipping
        self.predivide = gradient_predivide_factor
        shard_count = grid.shard.size if self.stage_policy.partition_optimizer else 1
        # Stage 0 reduces over the whole data-parallel world; sharded stages over the shard group,
        # then across replica groups.
        shard_group = grid.shard if self.stage_policy.partition_optimizer else grid.world
        replica_group = (
            grid.replica if self.stage_policy.partition_optimizer else comm.Group("replica", (comm.get_rank(),), None)
        )

        self.flat_groups: list[FlatGroup] = []
        self._owner: dict[torch.nn.Parameter, tuple[FlatGroup, int]] = {}
        masters: list[list[torch.Tensor]] = [[] for _ in param_groups]
        for plan in plan_flat_groups(param_groups, self.stage_policy, bucket_size, units, persistent):
            if materialize is not None:
                materialize(plan.params)  # zero.Init: one flat group's parameters at a time
            layout = flat_layout(
                [param_names[p] for p in plan.params], [tuple(p.shape) for p in plan.params], shard_count
            )
            flat = FlatGroup(layout, plan.params, policy, shard_group, replica_group, device, plan.resident)
            self.flat_groups.append(flat)
            gathered.register(flat)
            masters[plan.group_index].append(flat.master)
            for position, param in enumerate(plan.params):
                self._owner[param] = (flat, position)
        master_groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": m} for g, m in zip(param_groups, masters)
        ]
        self.optimizer = make_optimizer(master_groups)
        self.on_flat_group_complete: Optional[Callable[[FlatGroup], None]] = None
        if isinstance(self.optimizer, Lamb):
            self.optimizer.sharded_norms = self._lamb_norms()
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._owner]
        self._reducing = False
        self._next_launch = 0
        self.global_grad_norm: Optional[float] = None

    # -- gradient arrival and reduction -------------------------------------------------------
    def begin_backward(self, boundary: bool) -> None:
        self._reducing = boundary or self.stage_policy.reduce_every_micro_step
        self._next_launch = 0

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        if not self._reducing:
            return  # gradients accumulate in param.grad until the boundary
        flat, position = self._owner[param]
        flat.stage_grad(position, param.grad)
        param.grad = None
        if flat.complete and self.on_flat_group_complete is not None:
            self.on_flat_group_complete(flat)
        if self.overlap_comm:
            self._launch_ready()

    def _launch_ready(self) -> None:
        # Launch strictly in flat-group order so every rank issues the same sequence of collectives,
        # even when ranks produce gradients in different orders or skip unused parameters.
        while self._next_launch < len(self.flat_groups) and self.flat_groups[self._next_launch].complete:
            self.flat_groups[self._next_launch].launch_reduce(self.predivide, async_op=True)
            self._next_launch += 1

    def end_backward(self) -> None:
        if not self._reducing:
            return
        for flat in self.flat_groups[self._next_launch :]:
            flat.launch_reduce(self.predivide, async_op=True)
        post_scale = self.predivide / self.grid.world.size
        for flat in self.flat_groups:
            flat.finish_reduce(post_scale)
        self._reducing = False

    # -- the optimizer step -------------------------------------------------------------------
    def _grad_norm_squared(self, grads: list[torch.Tensor]) -> torch.Tensor:
        if not grads:
            return torch.zeros((), dtype=torch.float32)
        squared = torch.stack(torch._foreach_norm(grads)).pow(2).sum().reshape(1)
        if self.stage_policy.partition_optimizer:
            comm.all_reduce(squared, self.grid.shard)
        return squared

    def step(self) -> bool:
        """Unscale, clip and apply the reduced gradients; returns False when an fp16 overflow skipped the step."""
        scale = self.loss_scaler.scale
        # the optimizer needs gradients in the master dtype (a transient copy when shards are 16-bit)
        grads = [f.grad if f.grad.dtype == f.master.dtype else f.grad.to(f.master.dtype) for f in self.flat_groups]
        norm = math.sqrt(self._grad_norm_squared(grads).item()) / scale
        overflow = not math.isfinite(norm)
        self.global_grad_norm = norm
        self.loss_scaler.update(overflow)
        if overflow:
            self.zero_grad()
            return False
        coef = 1.0 / scale
        if self.gradient_clipping > 0 and norm > self.gradient_clipping:
            coef *= self.gradient_clipping / (norm + 1e-6)
        if coef != 1.0 and grads:
            torch._foreach_mul_(grads, coef)
        for flat, grad in zip(self.flat_groups, grads):
            flat.master.grad = grad
        self.optimizer.step()
        for flat in self.flat_groups:
            flat.master.grad = None
            flat.publish()
        self.zero_grad()
        return True

    def zero_grad(self) -> None:
        for flat in self.flat_groups:
            flat.grad.zero_()
            for param in flat.params:
                param.grad = None

    # -- introspection ----------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def state_bytes(self) -> dict[str, int]:
        """Bytes of model state this rank holds, counted from the tensors themselves."""
        totals = {"params": 0, "gathered": 0, "master": 0, "grad_shard": 0, "staging": 0, "optimizer_state": 0}
        for flat in self.flat_groups:
            for key, value in flat.bytes_held().items():
                totals[key] += value
        for state in self.optimizer.state.values():
            for value in state.values():
                if torch.is_tensor(value) and value.dim() > 0:
                    totals["optimizer_state"] += value.numel() * value.element_size()
        return totals

    def _lamb_norms(self) -> ShardedNorms:
        segments: dict[int, list[tuple[int, int, int]]] = {}
        slot_id = 0
        for flat in self.flat_groups:
            first = slot_id
            segments[id(flat.master)] = [
                (first + flat.layout.slots.index(seg.slot), seg.shard_start, seg.numel)
                for seg in flat.layout.segments(flat.shard_rank)
            ]
            slot_id += len(flat.layout.slots)
        reduce = (
            (lambda t: comm.all_reduce(t, self.grid.shard))
            if self.stage_policy.partition_optimizer
            else (lambda t: None)
        )
        return ShardedNorms(segments, slot_id, reduce)
