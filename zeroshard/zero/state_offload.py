"""Moving an engine's training state off the compute device and back (DeepSpeed's ``offload_states`` /
``reload_states``): RLHF trainers that colocate several models (OpenRLHF's actor and critic) hand the device to one
model while the other waits.

Each state tensor's *storage* moves: its bytes are copied into a host buffer and the storage is resized to zero,
which frees the device memory while every tensor viewing it (the parameters viewing a flat group's buffer, a
shard viewing its buffer) stays the same object; reloading resizes the storage back and copies the bytes in. The
round trip is bit-exact, and nothing that refers to these tensors needs to know. A storage shared by two kinds
(the fp32 master that *is* the compute shard) moves once both are offloaded.

While offloaded, a step, a backward, a load and the per-parameter accessors are refused by name
(:class:`StatesOffloadedError`); a forward and reading the weights are refused only while the compute parameters
are away (OpenRLHF offloads everything else around generation); a checkpoint saves the true state, read from the
host copies (:meth:`StateOffload.readable`). Only storages on the compute device move: what already
lives on the host (``offload_optimizer``) stays, as in DeepSpeed. On a CPU-only machine the compute device is
the host, and the storages still move (into separate host buffers), so the mechanism runs the same way.
"""

from __future__ import annotations

from enum import Enum
from typing import Iterable, Iterator, Optional

import torch

from ..accelerator import copy_across, get_accelerator
from .buffers import ReusableBuffers
from .flat_group import FlatGroup
from .optimizer_state import OptimizerState
from .reducer import GradBucket


class StateKind(str, Enum):
    """What can be offloaded (DeepSpeed's ``OffloadStateTypeEnum`` values)."""

    optim_states = "optim_states"  # the optimizer's state (exp_avg, exp_avg_sq, ...)
    hp_params = "hp_params"  # fp32 master weights
    lp_params = "lp_params"  # compute-precision parameters: stage-3 shards, stage 0-2 buffers
    lp_grads = "lp_grads"  # gradient shards
    contiguous_grad_buffer = "contiguous_grad_buffer"  # idle gather and gradient staging buffers (freed, not moved)


TRAINING = frozenset(StateKind) - {StateKind.contiguous_grad_buffer}  # a step needs every state on the device
COMPUTE = frozenset({StateKind.lp_params})  # a forward, or reading the weights, needs the compute parameters


class StatesOffloadedError(RuntimeError):
    """The engine was used while its states were on the host."""


class StateOffload:
    """The states one ZeRO optimizer holds, and which of them are on the host now."""

    def __init__(
        self,
        flats: list[FlatGroup],
        state: OptimizerState,
        buckets: list[GradBucket],
        buffers: ReusableBuffers,
        device: torch.device,
    ):
        self.flats = flats  # trainable and frozen
        self.state = state
        self.buckets = buckets
        self.buffers = buffers
        self.device = device
        self._moved: list[tuple[torch.UntypedStorage, torch.Tensor]] = []  # storage, its bytes on the host
        self.offloaded: set[StateKind] = set()

    def _tensors(self, kind: StateKind) -> Iterator[Optional[torch.Tensor]]:
        if kind is StateKind.optim_states:
            for per_param in self.state.optimizer.state.values():
                yield from (v for v in per_param.values() if torch.is_tensor(v) and v.dim() > 0)
        elif kind is StateKind.hp_params:
            yield from (sub.param for sub in self.state.subgroups)
        elif kind is StateKind.lp_params:
            for flat in self.flats:
                yield flat.shard
                yield flat.buffer
        elif kind is StateKind.lp_grads:
            yield from (bucket.home.resident() for bucket in self.buckets)  # None for a shard on disk

    def offload(self, include: Optional[Iterable], pin_memory: bool, non_blocking: bool) -> None:
        if isinstance(include, (str, StateKind)) or getattr(include, "value", None) is not None:
            include = [include]  # one state named alone (include="optim_states"), not its characters
        kinds = list(StateKind) if include is None else [_kind(k) for k in include]
        if StateKind.contiguous_grad_buffer in kinds:
            self.buffers.clear()
        self.offloaded.update(kinds)
        pin = pin_memory and get_accelerator().can_pin_memory
        already = {id(storage) for storage, _ in self._moved}
        for storage, holders in self._storages().values():
            if id(storage) in already or storage.nbytes() == 0 or not holders <= self.offloaded:
                continue
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
            copy_across(host, _bytes_of(storage, self.device), to_host=True, non_blocking=non_blocking)
            self._moved.append((storage, host))
        if non_blocking:
            get_accelerator().synchronize()  # the copies must land before the storages are freed
        for storage, _ in self._moved:
            storage.resize_(0)
        get_accelerator().empty_cache()

    def _storages(self) -> dict[int, tuple[torch.UntypedStorage, set[StateKind]]]:
        """Each device storage the states use, with the kinds that hold it. A storage moves once every kind holding
        it is offloaded: the fp32 master that *is* the compute shard stays while the compute parameters stay (as
        DeepSpeed keeps them), so a forward still runs after ``offload_states(include=[hp_params, ...])``."""
        found: dict[int, tuple[torch.UntypedStorage, set[StateKind]]] = {}
        for kind in StateKind:
            for tensor in self._tensors(kind):
                if tensor is not None and tensor.device == self.device:
                    storage = tensor.untyped_storage()  # the same object for every view while one is alive
                    found.setdefault(id(storage), (storage, set()))[1].add(kind)
        return found

    def reload(self, non_blocking: bool) -> None:
        for storage, host in self._moved:
            storage.resize_(host.numel())
            copy_across(_bytes_of(storage, self.device), host, to_host=False, non_blocking=non_blocking)
        if not non_blocking:
            get_accelerator().synchronize()
        self._moved.clear()
        self.offloaded.clear()

    def refuse_use(self, call: str, needs: frozenset[StateKind] = TRAINING) -> None:
        """Raise by name when a state ``call`` needs is on the host."""
        if self.offloaded & needs:
            held = sorted(k.value for k in self.offloaded & needs)
            raise StatesOffloadedError(
                f"{call}: the engine's states {held} are offloaded to the host; call engine.reload_states() first"
            )

    def readable(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` itself, or, while its storage is on the host, a host tensor of the same dtype, offset, shape
        and strides viewing the saved bytes: a checkpoint written while offloaded holds the true state, with no
        device memory taken back."""
        storage = tensor.untyped_storage()
        host = next((host for moved, host in self._moved if moved is storage), None)  # the storage object is kept
        if host is None:
            return tensor
        return torch.empty(0, dtype=tensor.dtype).set_(
            host.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride()
        )


def _kind(value) -> StateKind:
    try:
        return StateKind(getattr(value, "value", value))
    except ValueError:
        raise ValueError(
            f"offload_states: unknown state {value!r}; expected one of {[k.value for k in StateKind]}"
        ) from None


def _bytes_of(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
