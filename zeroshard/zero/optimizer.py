"""The ZeRO optimizer for stages 0, 1 and 2: flat groups, gradient reduction, clipping, loss scaling.

The stages differ only in two policy bits (see ``StagePolicy``); the mechanism is shared:

- stage 0: one shard per flat group (everything replicated); gradients all-reduced once per
  optimizer step.
- stage 1: master weights and optimizer state sharded; gradients accumulate in ``param.grad``
  across micro-batches and are reduce-scattered once at the accumulation boundary.
- stage 2: also gradients sharded: each micro-batch's gradients are reduce-scattered bucket by
  bucket as backward produces them and ``param.grad`` is freed at once.

Without offload the optimizer steps every flat group's master shard in one call. With
``offload_optimizer`` the shards are cut into sub-groups (``sub_group_size``) stepped one at a time
on the CPU, each one's update copied to the compute parameters while the next is stepped; with NVMe
the sub-groups are also swapped in and out around their turn (``zeroshard.offload``).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .. import comm
from ..accelerator import get_accelerator
from ..offload import OffloadPlan, SubGroup
from ..offload.optimizer_swap import MASTER, elementwise_keys
from ..optim import Lamb
from ..optim.lamb import ShardedNorms
from ..partition import assign_buckets, flat_layout
from ..precision import LossScaler, PrecisionPolicy
from . import gathered
from .flat_group import FlatGroup


class NonFiniteGradientError(RuntimeError):
    """Gradients were inf/nan for too many optimizer steps in a row with no loss scale to recover them."""


MAX_IN_FLIGHT = 2  # overlapped reductions pending at once (each holds one bucket's staging buffer)


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


class ZeroOptimizer(torch.optim.Optimizer):
    """Owns the flat groups of every optimizer parameter group and drives one optimizer over their shards.

    It is a ``torch.optim.Optimizer`` to the clients that check (Lightning, Accelerate, LR schedulers bound to
    ``engine.optimizer``): ``param_groups``, ``state``, ``defaults``, ``step``, ``zero_grad``, ``state_dict`` and
    ``load_state_dict`` are its own; the base class's constructor is not run (the groups are the wrapped
    optimizer's)."""

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
        max_consecutive_skipped_steps: int = 0,
        ignore_unused_parameters: bool = True,
        device: torch.device,
        units: Optional[list[list[torch.nn.Parameter]]] = None,
        persistent: frozenset = frozenset(),
        materialize: Optional[Callable[[list[torch.nn.Parameter]], None]] = None,
        offload: Optional[OffloadPlan] = None,
    ):
        self.stage = stage
        self.stage_policy = StagePolicy.for_stage(stage)
        self.grid = grid
        self.policy = policy
        self.loss_scaler = loss_scaler
        self.overlap_comm = overlap_comm
        self.gradient_clipping = gradient_clipping
        self.predivide = gradient_predivide_factor
        self.max_consecutive_skipped_steps = max_consecutive_skipped_steps
        self.ignore_unused_parameters = ignore_unused_parameters
        self.consecutive_skipped = 0
        self.steps_taken = 0  # optimizer steps attempted (applied or skipped)
        shard_count = grid.shard.size if self.stage_policy.partition_optimizer else 1
        # Stage 0 reduces over the whole data-parallel world; sharded stages over the shard group,
        # then across replica groups.
        shard_group = grid.shard if self.stage_policy.partition_optimizer else grid.world
        replica_group = (
            grid.replica if self.stage_policy.partition_optimizer else comm.Group("replica", (comm.get_rank(),), None)
        )

        self.offload = offload or OffloadPlan()
        plans = plan_flat_groups(param_groups, self.stage_policy, bucket_size, units, persistent)
        layouts = [
            flat_layout([param_names[p] for p in plan.params], [tuple(p.shape) for p in plan.params], shard_count)
            for plan in plans
        ]
        largest = max((layout.shard_numel for layout in layouts), default=1)
        self.swapper = self.offload.optimizer_swapper(
            min(largest, self.offload.sub_group_size), get_accelerator().synchronize
        )
        shard_home = self.offload.shard_homes(policy.compute, largest)
        self.flat_groups: list[FlatGroup] = []
        self.subgroups: list[SubGroup] = []  # what the optimizer steps, in flat-group order
        self._owner: dict[torch.nn.Parameter, tuple[int, int]] = {}  # parameter -> (flat group index, position)
        self.param_names = param_names
        opt_params: list[list[torch.Tensor]] = [[] for _ in param_groups]
        for plan, layout in zip(plans, layouts):
            if materialize is not None:
                materialize(plan.params)  # zero.Init: one flat group's parameters at a time
            flat = FlatGroup(
                layout,
                plan.params,
                policy,
                shard_group,
                replica_group,
                device,
                plan.resident,
                offload_optimizer=self.offload.offloads_optimizer,
                state_device=torch.device("cpu") if self.offload.offloads_optimizer else None,
                pin_memory=self.offload.pin_memory,
                shard_home=shard_home,
            )
            self.flat_groups.append(flat)
            gathered.register(flat)
            for sub in self._split(len(self.flat_groups) - 1, flat):
                opt_params[plan.group_index].append(sub.param)
                self.subgroups.append(sub)
            for position, param in enumerate(plan.params):
                self._owner[param] = (len(self.flat_groups) - 1, position)
        self._subgroups_of = [[s for s in self.subgroups if s.flat_index == k] for k in range(len(self.flat_groups))]
        master_groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": m} for g, m in zip(param_groups, opt_params)
        ]
        self.optimizer = make_optimizer(master_groups)
        self.defaults = self.optimizer.defaults
        self.overflow = False  # DeepSpeed's name: whether the last step was skipped for non-finite gradients
        if self.offload.offloads_optimizer and isinstance(self.optimizer, Lamb):
            raise ValueError(
                "optimizer Lamb needs whole-parameter norms across sub-groups and cannot run with "
                "zero_optimization.offload_optimizer; use Adam/AdamW, Adagrad, Lion or SGD, or remove the offload"
            )
        if self.swapper is not None:
            if any(self.optimizer.state.values()):
                raise ValueError(
                    f"{type(self.optimizer).__name__} creates its state when constructed, which NVMe offload "
                    "cannot swap; with offload_optimizer.device 'nvme' use Adam, AdamW, Lion or SGD"
                )
            self.swapper.optimizer = self.optimizer
        self.on_flat_group_complete: Optional[Callable[[FlatGroup], None]] = None
        if isinstance(self.optimizer, Lamb):
            self.optimizer.sharded_norms = self._lamb_norms()
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._owner]
        self._reducing = False
        self._next_launch = 0
        self._outer_task: Optional[int] = None  # autograd graph task of the engine's backward call
        self._launch_limit = 0  # flat groups from this index wait for the end of backward (see _on_grad)
        self._in_flight: deque[FlatGroup] = deque()  # reductions launched, not yet accumulated
        self.global_grad_norm: Optional[float] = None

    def _split(self, index: int, flat: FlatGroup) -> list[SubGroup]:
        """The optimizer's tensors for one flat group: its whole master shard, or (offloaded) sub-groups of
        at most ``sub_group_size`` elements; on NVMe the master leaves memory here."""
        if not self.offload.offloads_optimizer:
            return [SubGroup(index, 0, flat.master.numel(), flat.master)]
        numel, size = flat.master.numel(), self.offload.sub_group_size
        subs = []
        for start in range(0, numel, size):
            stop = min(start + size, numel)
            if self.swapper is None:
                subs.append(SubGroup(index, start, stop, flat.master[start:stop]))
            else:
                sub = SubGroup(index, start, stop, torch.empty(0))
                self.swapper.write(sub, {MASTER: flat.master[start:stop]})
                subs.append(sub)
        if self.swapper is not None:
            flat.master = None
            flat.write_master = lambda values, subs=subs: [
                self.swapper.write(s, {MASTER: values[s.start : s.stop]}) for s in subs
            ]
        return subs

    # -- gradient arrival and reduction -------------------------------------------------------
    def begin_backward(self, boundary: bool, root: torch.Tensor) -> None:
        """Called before ``root.backward()``; ``root`` tells which autograd graph task is the outer backward."""
        self._reducing = boundary or self.stage_policy.reduce_every_micro_step
        self._next_launch = 0
        self._launch_limit = len(self.flat_groups)
        self._outer_task = None
        if root.requires_grad:
            root.register_hook(self._note_outer_task)

    def _note_outer_task(self, grad: torch.Tensor) -> None:
        self._outer_task = torch._C._current_graph_task_id()

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        """Note [gradient contributions]: a parameter's hook fires once per backward graph that reaches it. In
        one graph, autograd sums all uses first; but reentrant activation checkpointing (``use_reentrant=True``)
        recomputes each region and runs a nested backward for it, so a parameter used in k such regions fires k
        times. Contributions are added in staging; a flat group is reduced once every parameter brought as many
        as in the last backward. The first time a parameter's gradient comes from a nested backward, how many
        will follow is unknown: that flat group (and, to keep every rank's collectives in one order, the ones
        after it) waits for the end of backward. A contribution after its group's reduction started is refused."""
        if not self._reducing:
            return  # gradients accumulate in param.grad until the boundary
        index, position = self._owner[param]
        flat = self.flat_groups[index]
        if index < self._next_launch:
            raise RuntimeError(
                f"rank {comm.get_rank()}: parameter '{self.param_names[param]}' received another gradient after "
                "its reduction had started: it is used again in a later part of backward (e.g. both inside and "
                "outside a reentrant activation checkpoint), whose gradient zeroshard cannot add any more. Use "
                "torch.utils.checkpoint.checkpoint(..., use_reentrant=False)"
            )
        nested = torch._C._current_graph_task_id() != self._outer_task
        if nested and flat.expected[position] is None:
            self._launch_limit = min(self._launch_limit, index)
        was_complete = flat.complete
        flat.stage_grad(position, param.grad)
        param.grad = None
        if flat.complete and not was_complete and self.on_flat_group_complete is not None:
            # only on becoming complete: a further recomputation, gathered again, still needs its weights
            self.on_flat_group_complete(flat)
        self._launch_ready()

    def _launch_ready(self) -> None:
        """Reduce the flat groups whose gradients are complete, strictly in flat-group order so every rank
        issues the same sequence of collectives (even when ranks produce gradients in different orders or
        skip unused parameters). At most ``MAX_IN_FLIGHT`` reductions (none without ``overlap_comm``) stay
        pending, so staging memory is a few buckets, never the whole model's gradients."""
        limit = MAX_IN_FLIGHT if self.overlap_comm else 0
        while self._next_launch < self._launch_limit and self.flat_groups[self._next_launch].complete:
            flat = self.flat_groups[self._next_launch]
            flat.launch_reduce(self.predivide, async_op=self.overlap_comm)
            self._in_flight.append(flat)
            self._next_launch += 1
            while len(self._in_flight) > limit:
                self._in_flight.popleft().finish_reduce(self.predivide / self.grid.world.size)

    def end_backward(self) -> None:
        if not self._reducing:
            return
        if not self.ignore_unused_parameters:
            self._refuse_unused()
        for flat in self.flat_groups[self._next_launch :]:
            flat.launch_reduce(self.predivide, async_op=True)
            self._in_flight.append(flat)
        while self._in_flight:
            self._in_flight.popleft().finish_reduce(self.predivide / self.grid.world.size)
        self._reducing = False

    def _refuse_unused(self) -> None:
        """``ignore_unused_parameters: false`` (DeepSpeed's stage-3 check): a trainable parameter that received no
        gradient in this backward stops training on every rank (one small all-reduce agrees on it)."""
        unused = [
            self.param_names[param]
            for flat in self.flat_groups[self._next_launch :]
            for param, arrived in zip(flat.params, flat.arrived)
            if not arrived
        ]
        count = torch.tensor([len(unused)], dtype=torch.int64)
        comm.all_reduce(count, self.grid.world, op="max")
        if count.item():
            where = f"{unused[:8]}{' ...' if len(unused) > 8 else ''}" if unused else "(on another rank)"
            raise RuntimeError(
                f"rank {comm.get_rank()}: parameters received no gradient in this backward {where}, and "
                "zero_optimization.ignore_unused_parameters is false; freeze them (requires_grad=False), use them, "
                "or set ignore_unused_parameters to true"
            )

    # -- the optimizer step -------------------------------------------------------------------
    def _grad_norm_squared(self, grads: list[torch.Tensor]) -> torch.Tensor:
        if not grads:
            return torch.zeros((), dtype=torch.float32)
        squared = torch.stack(torch._foreach_norm(grads)).pow(2).sum().reshape(1)
        if self.stage_policy.partition_optimizer:
            comm.all_reduce(squared, self.grid.shard)
        return squared

    def step(self, closure=None) -> bool:
        """Unscale, clip and apply the reduced gradients; returns False when an fp16 overflow skipped the step.
        A ``closure`` (torch's convention) is evaluated first."""
        if closure is not None:
            with torch.enable_grad():
                closure()
        scale = self.loss_scaler.scale
        # the optimizer needs gradients in the master dtype (a transient copy when shards are 16-bit)
        master_dtype = self.policy.master
        grads = [f.grad if f.grad.dtype == master_dtype else f.grad.to(master_dtype) for f in self.flat_groups]
        norm = math.sqrt(self._grad_norm_squared(grads).item()) / scale
        overflow = self.overflow = not math.isfinite(norm)
        self.global_grad_norm = norm
        self.steps_taken += 1
        self.loss_scaler.update(overflow)
        if overflow:
            self.consecutive_skipped += 1
            limit = self.max_consecutive_skipped_steps
            if not self.loss_scaler.dynamic and limit and self.consecutive_skipped >= limit:
                raise NonFiniteGradientError(
                    f"optimizer step {self.steps_taken}: gradients were non-finite for {self.consecutive_skipped} "
                    f"steps in a row (every one skipped), first at parameter '{self._first_non_finite(grads)}'; "
                    "check the loss and the data for inf/nan, lower the learning rate, or raise "
                    "max_consecutive_skipped_steps (0 never stops)"
                )
            self.zero_grad()
            return False
        self.consecutive_skipped = 0
        coef = 1.0 / scale
        if self.gradient_clipping > 0 and norm > self.gradient_clipping:
            coef *= self.gradient_clipping / (norm + 1e-6)
        if coef != 1.0 and grads:
            torch._foreach_mul_(grads, coef)
        if self.offload.offloads_optimizer:
            self._step_streamed(grads)
        else:  # one fused optimizer call over every master shard
            for sub, grad in zip(self.subgroups, grads):
                sub.param.grad = grad
            self.optimizer.step()
            for sub in self.subgroups:
                sub.param.grad = None
            self.publish()
        self.zero_grad()
        return True

    def _first_non_finite(self, grads: list[torch.Tensor]) -> str:
        """The first parameter, in flat-group order over all ranks' shards, with a non-finite gradient."""
        big = len(self.flat_groups) * (1 << 40)
        first = torch.tensor([big], dtype=torch.int64)
        for index, (flat, grad) in enumerate(zip(self.flat_groups, grads)):
            bad = (~torch.isfinite(grad)).nonzero()
            if bad.numel():
                lo, _ = flat.layout.shard_range(flat.shard_rank)
                first[0] = index * (1 << 40) + lo + int(bad[0, 0])
                break
        if self.stage_policy.partition_optimizer:
            comm.all_reduce(first, self.grid.shard, op="min")
        index, offset = divmod(int(first.item()), 1 << 40)
        if index >= len(self.flat_groups):
            return "?"
        slot = next((s for s in self.flat_groups[index].layout.slots if s.offset <= offset < s.end), None)
        return slot.name if slot is not None else "?"

    def publish(self) -> None:
        """Copy the master weights into the compute parameters (after they were replaced, e.g. by a load)."""
        for sub in self.subgroups:
            values = self.swapper.read(sub, [MASTER])[MASTER] if self.swapper is not None else sub.param.detach()
            self._write_back(sub, values)

    def _write_back(self, sub: SubGroup, values: torch.Tensor) -> None:
        """Updated master values into the compute parameters; a flat group is finished (its NVMe home
        written, a resident group gathered) with its last sub-group, freeing its staging at once."""
        flat = self.flat_groups[sub.flat_index]
        flat.write_shard(sub.start, values)
        if sub.stop == flat.layout.shard_numel:
            flat.finish_publish()

    def _step_streamed(self, grads: list[torch.Tensor]) -> None:
        """Offload: one sub-group at a time on the CPU; each update's copy to the compute parameters is
        issued (non-blocking) before the next sub-group is stepped, and NVMe state streams in and out."""
        subs = self.swapper.steps(self.subgroups) if self.swapper is not None else self.subgroups
        for sub in subs:
            sub.param.grad = grads[sub.flat_index][sub.start : sub.stop]
            self.optimizer.step()
            sub.param.grad = None
            self._write_back(sub, sub.param.detach())

    def zero_grad(self, set_to_none: bool = True) -> None:
        for flat in self.flat_groups:
            flat.grad.zero_()
            for param in flat.params:
                param.grad = None

    def destroy(self) -> None:
        """Finish the reductions still in flight and remove the gradient hooks (see ``ZeroshardEngine.destroy``)."""
        while self._in_flight:
            self._in_flight.popleft().finish_reduce(self.predivide / self.grid.world.size)
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for flat in self.flat_groups:
            gathered.unregister(flat)

    # -- introspection ----------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def add_param_group(self, param_group: dict) -> None:
        raise NotImplementedError(
            "parameters cannot join a ZeRO optimizer after initialize (they would not be sharded or reduced); "
            "pass every parameter group to initialize"
        )

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale

    cur_scale = loss_scale  # DeepSpeed's fp16 optimizers use both names

    def state_dict(self) -> dict:
        """This rank's shard of the optimizer state (master weights, elementwise state and step counters per flat
        group) and the loss scaler: what a ZeRO optimizer's ``state_dict`` holds in DeepSpeed too. It loads back
        into the same world size and stage only; resharding goes through ``engine.save_checkpoint``."""
        return {
            "zeroshard_shard": {
                "shard_rank": [flat.shard_rank for flat in self.flat_groups],
                "shard_numel": [flat.layout.shard_numel for flat in self.flat_groups],
                "flat_groups": [
                    {"tensors": {k: v.clone() for k, v in self.read_flat(i).items()}, "scalars": self.flat_scalars(i)}
                    for i in range(len(self.flat_groups))
                ],
            },
            "loss_scaler": self.loss_scaler.state_dict(),
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
        }

    def load_state_dict(self, state_dict: dict) -> None:
        shard = state_dict.get("zeroshard_shard")
        if shard is None:
            raise ValueError("ZeroOptimizer.load_state_dict: not a zeroshard optimizer state (no 'zeroshard_shard')")
        mine = [flat.layout.shard_numel for flat in self.flat_groups]
        ranks = [flat.shard_rank for flat in self.flat_groups]
        if shard["shard_numel"] != mine or shard["shard_rank"] != ranks:
            raise ValueError(
                f"rank {comm.get_rank()}: optimizer state of shards {shard['shard_numel']} (shard ranks "
                f"{shard['shard_rank']}) does not fit this optimizer's {mine} ({ranks}): it was saved with another "
                "world size, stage or model; use engine.save_checkpoint/load_checkpoint to change those"
            )
        for index, group in enumerate(shard["flat_groups"]):
            self.write_flat(index, group["tensors"], group["scalars"])
        for target, saved in zip(self.param_groups, state_dict.get("param_groups", [])):
            target.update(saved)
        self.loss_scaler.load_state_dict(state_dict["loss_scaler"])
        self.publish()

    def state_bytes_by_location(self) -> dict[str, dict[str, int]]:
        """Bytes of model state this rank holds per location (``device``, ``host``, ``nvme``) and role,
        counted from the tensors (and swap-file regions) themselves."""
        roles = ("params", "gathered", "master", "grad_shard", "staging", "optimizer_state")
        totals = {where: dict.fromkeys(roles, 0) for where in ("device", "host", "nvme")}
        for flat in self.flat_groups:
            for role, places in flat.bytes_held().items():
                for where, nbytes in places.items():
                    totals[where][role] += nbytes
        state_side = "host" if self.offload.offloads_optimizer else "device"
        for state in self.optimizer.state.values():
            for value in state.values():
                if torch.is_tensor(value) and value.dim() > 0:
                    totals[state_side]["optimizer_state"] += value.numel() * value.element_size()
        if self.swapper is not None:
            for sub in self.subgroups:
                totals["nvme"]["master"] += sub.numel * 4
                totals["nvme"]["optimizer_state"] += sub.numel * 4 * len(self.swapper.state_keys.get(id(sub.param), []))
            totals["host"]["optimizer_state"] += self.swapper.bytes_in_memory()  # the staging buffers
        if self.offload.param_pool is not None:
            totals["host"]["params"] += self.offload.param_pool.bytes_in_memory
        return totals

    def state_bytes(self) -> dict[str, int]:
        """Bytes of model state this rank holds per role, wherever it lives."""
        by_location = self.state_bytes_by_location()
        return {role: sum(places[role] for places in by_location.values()) for role in by_location["device"]}

    # -- per-flat-group state, for checkpoints ------------------------------------------------
    def flat_state_keys(self, index: int) -> list[str]:
        """Names of the elementwise optimizer state tensors of one flat group (e.g. exp_avg, exp_avg_sq)."""
        first = self._subgroups_of[index][0]
        if self.swapper is not None:
            return sorted(self.swapper.state_keys.get(id(first.param), []))
        return elementwise_keys(self.optimizer.state.get(first.param, {}), first.param)

    def flat_scalars(self, index: int) -> dict:
        """The optimizer's non-elementwise state (e.g. step) of one flat group."""
        first = self._subgroups_of[index][0]
        state = self.optimizer.state.get(first.param, {})
        return {k: v for k, v in state.items() if not (torch.is_tensor(v) and v.dim() > 0)}

    def read_flat(self, index: int) -> dict[str, torch.Tensor]:
        """This rank's whole master shard and elementwise optimizer state of one flat group."""
        subs = self._subgroups_of[index]
        keys = [MASTER, *self.flat_state_keys(index)]
        if self.swapper is not None:
            parts = [self.swapper.read(s) for s in subs]
        else:
            parts = [{MASTER: s.param.detach(), **self.optimizer.state.get(s.param, {})} for s in subs]
        return {key: parts[0][key] if len(parts) == 1 else torch.cat([p[key] for p in parts]) for key in keys}

    def write_flat(self, index: int, tensors: dict[str, torch.Tensor], scalars: dict) -> None:
        """Replace one flat group's master shard and (when given) its optimizer state."""
        for sub in self._subgroups_of[index]:
            part = {key: value[sub.start : sub.stop] for key, value in tensors.items()}
            if self.swapper is not None:
                self.swapper.write(sub, part)
                if len(part) > 1:
                    self.optimizer.state[sub.param] = {k: _copy(v) for k, v in scalars.items()}
                continue
            sub.param.detach().copy_(part.pop(MASTER))
            if part:
                self.optimizer.state[sub.param] = {**part, **{k: _copy(v) for k, v in scalars.items()}}

    def _lamb_norms(self) -> ShardedNorms:
        # sub-groups are whole master shards here: Lamb is refused with offload
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


def _copy(value):
    return value.clone() if torch.is_tensor(value) else value
