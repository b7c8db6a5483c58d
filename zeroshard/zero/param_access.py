"""One parameter's training state, whole or this rank's part: fp32 master weights, the reduced gradient, optimizer
state (DeepSpeed's ``safe_get_full_fp32_param`` family, used by RLHF and analysis code).

A trainable parameter is one slot of a flat group; this rank's shard holds at most one contiguous fragment of it
(:meth:`~zeroshard.partition.layout.FlatLayout.segments`). The *local* calls read or write that fragment (a 1-D
tensor, empty when the shard holds none of the parameter) and issue no collective. The *full* calls are
collectives over the flat group's shard group (every rank calls them together): a read sums the fragments into a
zero tensor of the parameter's shape (each element comes from exactly one rank), a write keeps each rank's
fragment. Every stage and every home works the same way, since the reads and writes go through the optimizer
state's own ``read_flat`` / ``write_flat`` (device, host, NVMe).

While ``offload_states`` holds the states on the host every call raises ``StatesOffloadedError`` (before anything
is read or written): the storages are freed, and ``reload_states`` brings them back bit for bit.

Frozen parameters have no master weights, gradient or optimizer state: the reads answer ``None``, as DeepSpeed's.
Gradients are the reduced (data-parallel averaged) shards the next step applies: present between a
boundary's backward and the step (under fp16 still multiplied by the loss scale, as in DeepSpeed). After a 1-bit
optimizer's warm-up no averaged gradient exists (Note [1-bit reduction]): each rank holds its own, whole, and the
reads answer that rank's own gradient, the full one without a collective (DeepSpeed's 1-bit Adam, stage 0, too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .. import comm
from ..offload import MASTER
from .flat_group import FlatGroup
from .optimizer_state import OptimizerState
from .reducer import GradBucket, GradientReducer
from .sharded_param import ParamRecords
from .state_offload import StateOffload


@dataclass(frozen=True)
class _Fragment:
    """Where this rank's part of one parameter lives."""

    flat: FlatGroup
    index: int  # the flat group's position in the optimizer state
    shard_start: int  # offset inside the shard
    param_start: int  # offset inside the flattened parameter
    numel: int
    shape: torch.Size

    def of_shard(self, shard: torch.Tensor) -> torch.Tensor:
        return shard[self.shard_start : self.shard_start + self.numel]


class ParamAccess:
    """Reads and writes one parameter's state in an engine's ZeRO stack (see the module docstring)."""

    def __init__(self, records: ParamRecords, state: OptimizerState, reducer: GradientReducer, offload: StateOffload):
        self.records = records
        self.state = state
        self.offload = offload  # while the states are on the host, every call is refused by name
        self.buckets: dict[int, GradBucket] = {id(bucket.flat): bucket for bucket in reducer.buckets}
        self.check = reducer.check  # a gradient written here is not backward's: that step is not checked

    def _fragment(self, param: torch.nn.Parameter) -> Optional[_Fragment]:
        self.offload.refuse_use("engine.param_access (safe_get_full_fp32_param and its family)")
        owned = self.records.flat_of(param)
        if owned is None or owned[1] is not self.state:
            if not isinstance(param, torch.nn.Parameter):
                raise TypeError(f"expected a model parameter, got {type(param).__name__}")
            return None  # frozen, or not this engine's
        flat = owned[0]
        position = next(i for i, p in enumerate(flat.params) if p is param)
        slot = flat.layout.slots[position]
        segment = next((s for s in flat.layout.segments(flat.shard_rank) if s.slot == slot), None)
        index = next(k for k, f in enumerate(self.state.flats) if f is flat)
        shape = torch.Size(slot.shape)
        if segment is None:
            return _Fragment(flat, index, 0, 0, 0, shape)
        return _Fragment(flat, index, segment.shard_start, segment.flat_start - slot.offset, segment.numel, shape)

    def _state_tensor(self, fragment: _Fragment, key: str) -> torch.Tensor:
        tensors = self.state.read_flat(fragment.index)
        if key not in tensors or key == MASTER:
            known = sorted(k for k in tensors if k != MASTER)
            why = "the optimizer has no state yet: its first step creates it" if not known else f"it has {known}"
            raise KeyError(f"optimizer state key {key!r} not found: {why}")
        return tensors[key]

    # -- this rank's fragment: no collective -------------------------------------------------------------
    def local_fp32_param(self, param: torch.nn.Parameter) -> Optional[torch.Tensor]:
        fragment = self._fragment(param)
        if fragment is None:
            return None
        return fragment.of_shard(self.state.read_flat(fragment.index)[MASTER]).float().clone()

    def local_grad(self, param: torch.nn.Parameter) -> Optional[torch.Tensor]:
        fragment = self._fragment(param)
        return None if fragment is None else self._local_grad_view(fragment).float().clone()

    def set_local_grad(self, param: torch.nn.Parameter, value: torch.Tensor) -> None:
        """Write this rank's fragment of the reduced gradient the next step applies (DeepSpeed's
        ``safe_set_local_grad``; the units of :meth:`local_grad`, so under fp16 loss-scaled)."""
        fragment = self._required(param)
        if self.check is not None:
            self.check.forget()
        self._write_local_grad(fragment, _checked(value, fragment.numel, "this rank's fragment"))

    def _local_grad_view(self, fragment: _Fragment) -> torch.Tensor:
        bucket = self.buckets[id(fragment.flat)]
        return bucket.grad[self._local_grad_start(fragment) :][: fragment.numel]

    def _local_grad_start(self, fragment: _Fragment) -> int:
        """Where this rank's fragment starts in the bucket's gradient home (which holds the whole bucket at stage 0,
        or under a 1-bit optimizer's own phase)."""
        bucket, flat = self.buckets[id(fragment.flat)], fragment.flat
        lo = flat.layout.shard_range(flat.shard_rank)[0] if bucket.holds_whole else 0
        return lo + fragment.shard_start

    def _write_local_grad(self, fragment: _Fragment, values: torch.Tensor) -> None:
        self._write_grad(self.buckets[id(fragment.flat)].home, self._local_grad_start(fragment), values)

    def _write_grad(self, home, start: int, values: torch.Tensor) -> None:
        self.state.abandon_speculation()  # a step speculated from the gradient before this write is void
        home.write(start, values.to(home.dtype).reshape(-1))

    def local_optimizer_state(self, param: torch.nn.Parameter, key: str) -> Optional[torch.Tensor]:
        fragment = self._fragment(param)
        if fragment is None:
            return None
        return fragment.of_shard(self._state_tensor(fragment, key)).clone()

    def set_local_fp32_param(self, param: torch.nn.Parameter, value: torch.Tensor) -> None:
        """Write this rank's fragment of the master weights and of the compute copy. Under stages 1-2 the other
        ranks' whole copies see it after the next step (use :meth:`set_full_fp32_param` to see it at once)."""
        fragment = self._required(param)
        self._write_master(fragment, _checked(value, fragment.numel, "this rank's fragment"), publish=False)

    def set_local_optimizer_state(self, param: torch.nn.Parameter, value: torch.Tensor, key: str) -> None:
        fragment = self._required(param)
        self._write_state(fragment, _not_negative(key, _checked(value, fragment.numel, "this rank's fragment")), key)

    # -- the whole parameter: collectives over its shard group -------------------------------------------
    def full_fp32_param(self, param: torch.nn.Parameter) -> Optional[torch.Tensor]:
        fragment = self._fragment(param)
        return None if fragment is None else self._whole(fragment, self.local_fp32_param(param))

    def full_grad(self, param: torch.nn.Parameter) -> Optional[torch.Tensor]:
        fragment = self._fragment(param)
        if fragment is None:
            return None
        bucket, flat = self.buckets[id(fragment.flat)], fragment.flat
        if bucket.holds_whole:  # stage 0, or this rank's own whole gradient (1-bit phase): no collective
            slot = next(s for s, p in zip(flat.layout.slots, flat.params) if p is param)
            return bucket.grad[slot.offset : slot.end].float().clone().view(fragment.shape)
        return self._whole(fragment, self.local_grad(param))

    def set_full_grad(self, param: torch.nn.Parameter, value: torch.Tensor) -> None:
        """Every rank passes the parameter's whole gradient; each keeps what its buffer holds of it (the whole
        parameter where the bucket holds whole gradients: stage 0, or a 1-bit optimizer's own phase). DeepSpeed's
        ``safe_set_full_grad``: no collective, the caller's value is the reduced gradient."""
        fragment = self._required(param)
        if self.check is not None:
            self.check.forget()
        bucket, flat = self.buckets[id(fragment.flat)], fragment.flat
        whole = self._whole_value(fragment, value)
        if bucket.holds_whole:
            slot = next(s for s, p in zip(flat.layout.slots, flat.params) if p is param)
            self._write_grad(bucket.home, slot.offset, whole)
            return
        self._write_local_grad(fragment, whole[fragment.param_start : fragment.param_start + fragment.numel])

    def full_optimizer_state(self, param: torch.nn.Parameter, key: str) -> Optional[torch.Tensor]:
        fragment = self._fragment(param)
        return None if fragment is None else self._whole(fragment, self.local_optimizer_state(param, key))

    def set_full_fp32_param(self, param: torch.nn.Parameter, value: torch.Tensor) -> None:
        fragment = self._required(param)
        mine = self._mine(fragment, value)
        self._write_master(fragment, mine, publish=True)

    def set_full_optimizer_state(self, param: torch.nn.Parameter, value: torch.Tensor, key: str) -> None:
        fragment = self._required(param)
        _not_negative(key, self._whole_value(fragment, value))  # the whole value: every rank refuses it alike
        self._write_state(fragment, self._mine(fragment, value), key)

    # -- the mechanics ---------------------------------------------------------------------------------
    def _required(self, param: torch.nn.Parameter) -> _Fragment:
        fragment = self._fragment(param)
        if fragment is None:
            raise ValueError(
                f"parameter {tuple(param.shape)} has no optimizer state in this engine (frozen, or another "
                "engine's): nothing to set"
            )
        return fragment

    def _whole(self, fragment: _Fragment, mine: torch.Tensor) -> torch.Tensor:
        whole = torch.zeros(fragment.shape.numel(), dtype=mine.dtype, device=mine.device)
        whole[fragment.param_start : fragment.param_start + fragment.numel].copy_(mine)
        if fragment.flat.partitioned:
            comm.all_reduce(whole, fragment.flat.shard_group)  # each element is non-zero on one rank only
        return whole.view(fragment.shape)

    def _mine(self, fragment: _Fragment, value: torch.Tensor) -> torch.Tensor:
        return self._whole_value(fragment, value)[fragment.param_start : fragment.param_start + fragment.numel]

    def _whole_value(self, fragment: _Fragment, value: torch.Tensor) -> torch.Tensor:
        if not torch.is_tensor(value) or tuple(value.shape) != tuple(fragment.shape):
            got = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
            raise ValueError(f"expected a tensor of the parameter's shape {tuple(fragment.shape)}, got {got}")
        return _checked(value.detach(), value.numel(), "")  # the whole value: every rank refuses it alike

    def _write_master(self, fragment: _Fragment, values: torch.Tensor, publish: bool) -> None:
        tensors = self.state.read_flat(fragment.index)
        master = tensors[MASTER].clone()
        fragment.of_shard(master).copy_(values)
        flat = fragment.flat
        flat.write_shard(0, master.to(flat.dtype))
        if publish:
            flat.finish_publish()  # an offloaded shard goes home; a resident group gathers every rank's update
        elif flat.home is not None:
            flat.home.flush()
        self.state.write_flat(fragment.index, {**tensors, MASTER: master}, self.state.scalars(fragment.index))

    def _write_state(self, fragment: _Fragment, values: torch.Tensor, key: str) -> None:
        self._state_tensor(fragment, key)  # names a missing key
        tensors = {k: v.clone() for k, v in self.state.read_flat(fragment.index).items()}
        fragment.of_shard(tensors[key]).copy_(values)
        self.state.write_flat(fragment.index, tensors, self.state.scalars(fragment.index))


NON_NEGATIVE_STATE = ("exp_avg_sq", "max_exp_avg_sq", "sum", "exp_inf")  # Adam's, Adagrad's, Adamax's second moments


def _not_negative(key: str, value: torch.Tensor) -> torch.Tensor:
    if key in NON_NEGATIVE_STATE and bool((value < 0).any()):
        raise ValueError(
            f"refusing a negative {key!r}: it is a mean (or maximum, or sum) of squares, never below 0, and the next "
            "step takes its square root"
        )
    return value


def _checked(value: torch.Tensor, numel: int, what: str) -> torch.Tensor:
    if not torch.is_tensor(value):
        raise TypeError(f"expected a tensor, got {type(value).__name__}")
    if value.numel() != numel:
        raise ValueError(f"expected {numel} element(s) ({what or 'the parameter'}), got {value.numel()}")
    if value.is_floating_point() and not bool(torch.isfinite(value).all()):
        raise ValueError("refusing a value with NaN or inf: it would poison the master weights")
    return value.reshape(-1)
