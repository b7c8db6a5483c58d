"""The ZeRO optimizer: one optimizer step over every flat group's shard, for stages 0-3.

It coordinates three owners (see ``docs/design.md``): the flat groups (compute-side parameters,
:mod:`.flat_group`), the gradient reducer (hooks, buckets, reductions, :mod:`.reducer`) and the optimizer
state in its home (master weights and optimizer state on the device, in host memory or on NVMe,
:mod:`.optimizer_state`). Its own job is the step's arithmetic: the global gradient norm, fp16 overflow
and loss scaling, clipping, then handing the gradients to the optimizer state.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .. import comm
from ..optim import OneBitOptimizer
from ..precision import LossScaler
from .buffers import ReusableBuffers
from .flat_group import FlatGroup
from .onebit_momentum import OneBitMomentum
from .optimizer_state import OptimizerState
from .reducer import GradientReducer, Reduction
from .state_offload import StateOffload


@dataclass(frozen=True)
class NormAxes:
    """Where the pieces of the global gradient norm live. ``shard``: the group whose shards make up each flat group's
    gradient (None: every rank holds it whole, stage 0). Under tensor parallelism, ``tensor``: the group over which
    the tensor-sharded flat groups (``FlatLayout.tensor_sharded``) hold different pieces (the others are replicated
    there: counted once)."""

    shard: Optional[comm.Group] = None
    tensor: Optional[comm.Group] = None

    @property
    def tensor_parallel(self) -> bool:
        return self.tensor is not None and self.tensor.size > 1


class NonFiniteGradientError(RuntimeError):
    """Gradients were inf/nan for too many optimizer steps in a row with no loss scale to recover them."""


class ZeroOptimizer(torch.optim.Optimizer):
    """Steps the optimizer state with the reducer's gradients.

    It is a ``torch.optim.Optimizer`` to the clients that check (Lightning, Accelerate, LR schedulers bound to
    ``engine.optimizer``): ``param_groups``, ``state``, ``defaults``, ``step``, ``zero_grad``, ``state_dict`` and
    ``load_state_dict`` are its own; the base class's constructor is not run (the groups are the wrapped
    optimizer's)."""

    def __init__(
        self,
        flat_groups: list[FlatGroup],
        optimizer_state: OptimizerState,
        reducer: GradientReducer,
        loss_scaler: LossScaler,
        *,
        frozen_groups: Optional[list[FlatGroup]] = None,
        norm: NormAxes,
        gradient_clipping: float = 0.0,
        max_consecutive_skipped_steps: int = 0,
        buffers: Optional[ReusableBuffers] = None,
    ):
        self.flat_groups = flat_groups
        self.optimizer_state = optimizer_state
        self.reducer = reducer
        self.loss_scaler = loss_scaler
        self.frozen_groups = frozen_groups or []  # stage 3: sharded parameters without gradients (never stepped)
        self.norm = norm
        self._tensor_sharded = torch.tensor([flat.layout.tensor_sharded for flat in flat_groups], dtype=torch.bool)
        self.gradient_clipping = gradient_clipping
        self.max_consecutive_skipped_steps = max_consecutive_skipped_steps
        self.optimizer = optimizer_state.optimizer
        self.defaults = self.optimizer.defaults
        self.consecutive_skipped = 0
        self.steps_taken = 0  # optimizer steps attempted (applied or skipped)
        self.overflow = False  # DeepSpeed's name: whether the last step was skipped for non-finite gradients
        self.global_grad_norm: Optional[float] = None
        self.compressed_from: Optional[int] = None  # the first global step of a 1-bit optimizer's compressed phase
        sharded = any(flat.partitioned for flat in flat_groups)
        if isinstance(self.optimizer, OneBitOptimizer) and sharded and not self.optimizer.runs_sharded:
            raise NotImplementedError(
                f"optimizer {type(self.optimizer).__name__} runs with zero_optimization.stage 0 only (it needs whole "
                "tensors on every rank); use stage 0, or OneBitAdam, which runs with ZeRO stages 0-3"
            )
        if isinstance(self.optimizer, OneBitOptimizer) and any(b.replica_group.size > 1 for b in reducer.buckets):
            raise NotImplementedError(
                f"optimizer {type(self.optimizer).__name__} with hybrid sharding (zero_hpz_partition_size / "
                "mics_shard_size): the replica groups' reduction would not be compressed; drop one of the two"
            )
        # 1-bit Adam's momentum, exchanged 1-bit compressed over the shard layout after its warm-up (at every stage)
        self.onebit_momentum = (
            OneBitMomentum(flat_groups)
            if isinstance(self.optimizer, OneBitOptimizer) and self.optimizer.runs_sharded
            else None
        )
        self.states = StateOffload(
            flat_groups + self.frozen_groups,
            optimizer_state,
            reducer.buckets,
            buffers if buffers is not None else ReusableBuffers(optimizer_state.device),
            flat_groups[0].device if flat_groups else optimizer_state.device,
        )
        self._choose_reduction()

    def offload_states(
        self, include=None, device: Any = "cpu", pin_memory: bool = True, non_blocking: bool = False
    ) -> None:
        """Move the states in ``include`` (DeepSpeed's ``OffloadStateTypeEnum`` values; all when None) to host
        memory, freeing the compute device (see :mod:`.state_offload`); the engine refuses to train until
        :meth:`reload_states`. Only ``device="cpu"``; ``"none"`` does nothing, as in DeepSpeed."""
        device = getattr(device, "value", device)
        if device == "none":
            logging.getLogger("zeroshard").warning("offload_states(device='none'): nothing to do")
            return
        if device != "cpu":
            raise ValueError(f"offload_states(device={device!r}): only 'cpu' is supported (as in DeepSpeed)")
        if any(flat.home is not None for flat in self.states.flats):
            raise NotImplementedError(
                "offload_states with zero_optimization.offload_param: the parameters already live off the device"
            )
        self.states.offload(include, pin_memory, non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Bring back what :meth:`offload_states` moved, bit for bit."""
        self.states.reload(non_blocking)

    def _choose_reduction(self) -> None:
        """Note [1-bit reduction]: a 1-bit optimizer past its warm-up takes this rank's own whole gradients; the
        step averages what DeepSpeed averages, 1-bit compressed (1-bit Adam's momentum: ``onebit_momentum``; the
        others, at stage 0, in the optimizer)."""
        optimizer, before = self.optimizer, self.reducer.reduction
        exact = not isinstance(optimizer, OneBitOptimizer) or optimizer.needs_averaged_gradients()
        self.reducer.reduction = Reduction.EXACT if exact else Reduction.LOCAL
        if before is Reduction.EXACT and self.reducer.reduction is not Reduction.EXACT and self.compressed_from is None:
            self.compressed_from = self.steps_taken + 1  # a global step: skipped steps count, unlike the optimizer's
            how = (
                "each rank's own gradients; the momentum exchanged 1-bit compressed over the shard layout"
                if self.onebit_momentum is not None
                else "each rank's own gradients, the optimizer averaging 1-bit compressed"
            )
            if comm.get_rank() == 0:  # zeroshard's logger (zeroshard.log formats it)
                logging.getLogger("zeroshard").info(
                    f"{type(optimizer).__name__}: exact warm-up done after {optimizer.steps_taken()} updates; from "
                    f"global step {self.compressed_from}: {how}"
                )

    # -- the optimizer step -------------------------------------------------------------------
    def _grad_norm_squared(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The squared global norm: over the data-parallel shards, then (tensor parallelism) the tensor-sharded
        flat groups' pieces summed over the tensor-parallel group, the replicated ones counted once."""
        if not grads:
            return torch.zeros((), dtype=torch.float32)
        per_flat = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).pow(2)
        if not self.norm.tensor_parallel:
            squared = per_flat.sum().reshape(1)
        else:
            sharded = self._tensor_sharded.to(per_flat.device)
            squared = torch.stack([per_flat[sharded].sum(), per_flat[~sharded].sum()])  # (tensor-sharded, replicated)
        if self.reducer.reduction is Reduction.LOCAL:
            # each rank holds its own gradient: every rank takes the mean of their squared norms, so overflow
            # skips and clipping agree across ranks (the averaged gradient is never formed)
            comm.all_reduce(squared, self.reducer.world)
            squared.div_(self.reducer.world.size)
        elif self.norm.shard is not None:
            comm.all_reduce(squared, self.norm.shard)
        if self.norm.tensor_parallel:
            comm.all_reduce(squared[:1], self.norm.tensor)
        return squared.sum().reshape(1)

    def step(self, closure=None) -> bool:
        """Unscale, clip and apply the reduced gradients; returns False when an fp16 overflow skipped the step.
        A ``closure`` (torch's convention) is evaluated first."""
        if closure is not None:
            with torch.enable_grad():
                closure()
        self.reducer.verify_gradients(self.steps_taken + 1)
        scale = self.loss_scaler.scale
        grads = self.reducer.grads  # 16-bit shards (stage 3) reach the master dtype one flat group at a time
        norm = math.sqrt(self._grad_norm_squared(grads).item()) / scale
        overflow = self.overflow = not math.isfinite(norm)
        self.global_grad_norm = math.inf if overflow else norm  # NaN gradients report inf too, as DeepSpeed's
        self.steps_taken += 1
        self.loss_scaler.update(overflow)
        if overflow:
            self.consecutive_skipped += 1
            limit = self.max_consecutive_skipped_steps
            if not self.loss_scaler.dynamic and limit and self.consecutive_skipped >= limit:
                raise NonFiniteGradientError(
                    f"optimizer step {self.steps_taken}: gradients were non-finite for {self.consecutive_skipped} "
                    f"steps in a row (every one skipped), first at parameter '{self._first_non_finite()}'; "
                    "check the loss and the data for inf/nan, lower the learning rate, or raise "
                    "max_consecutive_skipped_steps (0 never stops)"
                )
            self.zero_grad()
            self._choose_reduction()
            return False
        self.consecutive_skipped = 0
        coef = 1.0 / scale
        if self.gradient_clipping > 0 and norm > self.gradient_clipping:
            coef *= self.gradient_clipping / (norm + 1e-6)
        if self.onebit_momentum is not None and self.reducer.reduction is Reduction.LOCAL:
            grads, coef = self._exchange_momentum(grads, coef), 1.0
        self.optimizer_state.step(grads, coef)
        self.zero_grad()
        self._choose_reduction()
        return True

    def _exchange_momentum(self, grads: list[torch.Tensor], coef: float) -> list[torch.Tensor]:
        """1-bit Adam after its warm-up: this rank's own whole gradients (times ``coef``) in, the shards of the
        gradients that take the optimizer's momentum to the 1-bit averaged one out (:mod:`.onebit_momentum`)."""
        shards = []
        for index, grad in enumerate(grads):
            beta1 = self.param_groups[self.flat_param_group(index)]["betas"][0]
            exp_avg = None
            if self.onebit_momentum.needs_exp_avg(index):
                exp_avg = self.read_flat(index).get("exp_avg")
            shards.append(self.onebit_momentum.exchange(index, grad, coef, beta1, exp_avg))
        return shards

    def _first_non_finite(self) -> str:
        """The first parameter, in flat-group order over all ranks' shards, with a non-finite gradient."""
        big = len(self.flat_groups) * (1 << 40)
        first = torch.tensor([big], dtype=torch.int64)
        for index, (flat, bucket) in enumerate(zip(self.flat_groups, self.reducer.buckets)):
            bad = (~torch.isfinite(bucket.grad)).nonzero()
            if bad.numel():
                lo = 0 if bucket.holds_whole else flat.layout.shard_range(flat.shard_rank)[0]
                first[0] = index * (1 << 40) + lo + int(bad[0, 0])
                break
        if self.norm.shard is not None:
            comm.all_reduce(first, self.norm.shard, op="min")
        index, offset = divmod(int(first.item()), 1 << 40)
        if index >= len(self.flat_groups):
            return "?"
        slot = next((s for s in self.flat_groups[index].layout.slots if s.offset <= offset < s.end), None)
        return slot.name if slot is not None else "?"

    def publish(self) -> None:
        """Copy the master weights into the compute parameters (after they were replaced, e.g. by a load); a
        1-bit optimizer forgets its compression errors and resumes in the phase its loaded step count says."""
        self.optimizer_state.publish()
        if self.onebit_momentum is not None:
            self.onebit_momentum.reset()
        if isinstance(self.optimizer, OneBitOptimizer):
            self.optimizer.reset_compression()
        self._choose_reduction()

    def compression_state(self) -> dict[str, torch.Tensor]:
        """This rank's 1-bit Adam compression state (errors, the gathered momentum), for a checkpoint; {} otherwise."""
        return self.onebit_momentum.state_tensors() if self.onebit_momentum is not None else {}

    def load_compression_state(self, tensors: dict[str, torch.Tensor]) -> bool:
        """After :meth:`publish`: restore a checkpoint's compression state when it fits this layout exactly (a
        resume in the compressed phase is then bit-identical); returns whether it did."""
        return self.onebit_momentum is not None and self.onebit_momentum.load_state_tensors(tensors)

    def compression_bytes(self) -> int:
        """Bytes a 1-bit optimizer's compression holds: errors, the gathered momentum, 0/1 Adam's local updates."""
        held = self.onebit_momentum.nbytes() if self.onebit_momentum is not None else 0
        return held + (self.optimizer.compression_bytes() if isinstance(self.optimizer, OneBitOptimizer) else 0)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.reducer.zero_grad()

    def destroy(self) -> None:
        """Finish the reductions still in flight and remove the gradient hooks (see ``ZeroshardEngine.destroy``)."""
        self.reducer.destroy()

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

    # -- per-flat-group state, for checkpoints (``zeroshard.checkpoint.view.ShardedOptimizer``) ----------
    @property
    def kind(self) -> str:
        """The update rule, as a checkpoint records it. Adam and AdamW differ only in how they decay weights (torch's
        AdamW, DeepSpeed's CPU and fused Adams are one class with a flag), so that flag names them."""
        if isinstance(self.optimizer, torch.optim.Adam):
            return "AdamW" if self.optimizer.param_groups[0].get("decoupled_weight_decay") else "Adam"
        return type(self.optimizer).__name__

    @property
    def master_dtype(self) -> torch.dtype:
        return self.optimizer_state.master_dtype

    @property
    def state_device(self) -> torch.device:
        return self.optimizer_state.device

    def flat_param_group(self, index: int) -> int:
        """The optimizer parameter group of flat group ``index``."""
        return self.optimizer_state.group_of_flat[index]

    def flat_state_keys(self, index: int) -> list[str]:
        return self.optimizer_state.state_keys(index)

    def flat_scalars(self, index: int) -> dict:
        return self.optimizer_state.scalars(index)

    def read_flat(self, index: int) -> dict[str, torch.Tensor]:
        """One flat group's master shard and optimizer state; while offloaded, read from the host copies."""
        return {key: self.states.readable(t) for key, t in self.optimizer_state.read_flat(index).items()}

    def read_frozen(self, index: int) -> torch.Tensor:
        """A frozen flat group's shard (its only copy), read like :meth:`read_flat`."""
        return self.states.readable(self.frozen_groups[index].shard_values())

    def write_flat(self, index: int, tensors: dict[str, torch.Tensor], scalars: dict) -> None:
        self.optimizer_state.write_flat(index, tensors, scalars)
