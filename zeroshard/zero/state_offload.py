"""Moving an engine's training state off the compute device and back (DeepSpeed's ``offload_states`` /
``reload_states``): RLHF trainers that colocate several models (OpenRLHF's actor and critic) hand the device to one
model while the other waits.

Each state tensor's *storage* moves: its bytes are copied into a host buffer and the storage is resized to zero,
which frees the device memory while every tensor viewing it (the parameters viewing a flat group's buffer, a
shard viewing its buffer) stays the same object; reloading resizes the storage back and copies the bytes in. The
round trip is bit-exact, and nothing that refers to these tensors needs to know. Storages shared by two kinds
(the fp32 master that *is* the compute shard) move once. Only storages on the compute device move: what already
lives on the host (``offload_optimizer``) stays, as in DeepSpeed. On a CPU-only machine the compute device is
the host, and the storages still move (into separate host buffers), so the mechanism runs the same way.
"""

from __future__ import annotations

from enum import Enum
from typing import Iterable, Iterator, Optional

import torch

from ..accelerator import get_accelerator
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
            yield from (bucket.grad for bucket in self.buckets)

    def offload(self, include: Optional[Iterable], pin_memory: bool, non_blocking: bool) -> None:
        if isinstance(include, (str, StateKind)) or getattr(include, "value", None) is not None:
            include = [include]  # one state named alone (include="optim_states"), not its characters
        kinds = list(StateKind) if include is None else [_kind(k) for k in include]
        pin = pin_memory and get_accelerator().can_pin_memory
        moved = {storage.data_ptr() for storage, _ in self._moved}
        for kind in kinds:
            if kind in self.offloaded:
                continue
            if kind is StateKind.contiguous_grad_buffer:
                self.buffers.clear()
            for tensor in self._tensors(kind):
                if tensor is None or tensor.device != self.device:
                    continue
                storage = tensor.untyped_storage()
                if storage.nbytes() == 0 or storage.data_ptr() in moved:
                    continue
                moved.add(storage.data_ptr())
                host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
                host.copy_(_bytes_of(storage, tensor.device), non_blocking=non_blocking)
                self._moved.append((storage, host))
            self.offloaded.add(kind)
        if non_blocking:
            get_accelerator().synchronize()  # the copies must land before the storages are freed
        for storage, _ in self._moved:
            storage.resize_(0)
        get_accelerator().empty_cache()

    def reload(self, non_blocking: bool) -> None:
        for storage, host in self._moved:
            storage.resize_(host.numel())
            _bytes_of(storage, self.device).copy_(host, non_blocking=non_blocking)
        if not non_blocking:
            get_accelerator().synchronize()
        self._moved.clear()
        self.offloaded.clear()

    def refuse_use(self, call: str) -> None:
        if self.offloaded - {StateKind.contiguous_grad_buffer}:
            held = sorted(k.value for k in self.offloaded)
            raise StatesOffloadedError(
                f"engine.{call}: the engine's states {held} are offloaded to the host; call engine.reload_states() "
                "first"
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
