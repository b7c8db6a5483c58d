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
from ..partition import bucketed_layouts
from ..precision import LossScaler, PrecisionPolicy
from .flat_group import FlatGroup


@dataclass(frozen=True)
class StagePolicy:
    partition_optimizer: bool  # stages >= 1: master weights and optimizer state sharded
    reduce_every_micro_step: bool  # stage 2: gradients reduced (and freed) during every backward

    @classmethod
    def for_stage(cls, stage: int) -> "StagePolicy":
        if stage not in (0, 1, 2):
            raise NotImplementedError(f"zero_optimization.stage {stage} is not handled by the stage 0-2 optimizer")
        return cls(partition_optimizer=stage >= 1, reduce_every_micro_step=stage == 2)


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
        master_groups = []
        for group in param_groups:
            # reverse order: backward produces gradients roughly from the last parameter to the first
            trainable = [p for p in reversed(group["params"]) if p.requires_grad]
            names = [param_names[p] for p in trainable]
            members = []
            for layout in bucketed_layouts(names, [tuple(p.shape) for p in trainable], bucket_size, shard_count):
                params = [trainable[slot.index] for slot in layout.slots]
                flat = FlatGroup(layout, params, policy, shard_group, replica_group, device)
                members.append(flat)
                for position, param in enumerate(params):
                    self._owner[param] = (flat, position)
            self.flat_groups.extend(members)
            master_groups.append(
                {**{k: v for k, v in group.items() if k != "params"}, "params": [f.master for f in members]}
            )
        self.optimizer = make_optimizer(master_groups)
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
    def _grad_norm_squared(self) -> torch.Tensor:
        grads = [f.grad for f in self.flat_groups]
        if not grads:
            return torch.zeros((), dtype=torch.float32)
        squared = torch.stack(torch._foreach_norm(grads)).pow(2).sum().reshape(1)
        if self.stage_policy.partition_optimizer:
            comm.all_reduce(squared, self.grid.shard)
        return squared

    def step(self) -> bool:
        """Unscale, clip and apply the reduced gradients; returns False when an fp16 overflow skipped the step."""
        scale = self.loss_scaler.scale
        norm = math.sqrt(self._grad_norm_squared().item()) / scale
        overflow = not math.isfinite(norm)
        self.global_grad_norm = norm
        self.loss_scaler.update(overflow)
        if overflow:
            self.zero_grad()
            return False
        coef = 1.0 / scale
        if self.gradient_clipping > 0 and norm > self.gradient_clipping:
            coef *= self.gradient_clipping / (norm + 1e-6)
        grads = [f.grad for f in self.flat_groups]
        if coef != 1.0 and grads:
            torch._foreach_mul_(grads, coef)
        for flat in self.flat_groups:
            flat.master.grad = flat.grad
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
        totals = {"params": 0, "master": 0, "grad_shard": 0, "staging": 0, "optimizer_state": 0}
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
