"""Optimizer state on NVMe: fp32 master weights and elementwise optimizer state of every sub-group
live in one swap file; only ``buffer_count`` sub-groups are in host memory at any time.

The step streams through the sub-groups: while the optimizer updates one, the next ones are read
ahead and the previous ones written behind (``steps``). Each sub-group's reduced gradient can wait in the file too
(``write_grad`` during backward, written behind; read with its sub-group in the step): see
:class:`~zeroshard.zero.grad_home.SpilledGrad`. The optimizer itself is an ordinary
``torch.optim`` optimizer over one placeholder tensor per sub-group; before its sub-group is stepped
the placeholder's data and its state tensors are pointed at the staging buffer, and afterwards
pointed away again, so no optimizer tensor outlives its turn in memory.

Speculation (:mod:`zeroshard.zero.speculation`) steps a sub-group before the step's verdict is known, so it must not
write over the state it read: :meth:`NvmeOptimizerSwapper.enable_shadow` gives the master weights and every state key
a second region (a *twin*) of the file; a speculated step reads the current regions and writes the twins
(``steps(..., into_shadow=True)``), and :meth:`NvmeOptimizerSwapper.commit` makes the twins current (a swap of two
offsets). A discarded speculation leaves the current regions as they were: nothing is restored, because nothing
was overwritten. Gradients are not shadowed (a replay reads the same ones); with shadows the training thread's
gradient writes and reads use their own staging slots, since the step's slots are then busy on the worker thread
during backward.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch

from .aio import IOPending, SwapFile, align_up, aligned_empty
from .param_store import BufferPool

MASTER = "master"  # the key of the fp32 master weights beside the optimizer's state keys
GRAD = "grad"  # the key of a sub-group's fp32 gradient, when it waits in the file for the step
_SWAPPED_OUT = torch.empty(0)  # what a swapped-out sub-group's tensors point at


@dataclass
class SubGroup:
    """A contiguous range of one flat group's shard that the optimizer steps as one tensor."""

    flat_index: int
    start: int
    stop: int
    param: torch.Tensor  # the optimizer's parameter for this range

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass
class _Slot:
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # key -> aligned uint8 staging buffer
    reading: Optional[IOPending] = None
    writing: list[IOPending] = field(default_factory=list)

    def finish_writes(self) -> None:
        for pending in self.writing:
            pending.wait()
        self.writing = []


def elementwise_keys(state: dict, param: torch.Tensor) -> list[str]:
    """Optimizer state tensors shaped like the parameter (swapped and checkpointed per element)."""
    return sorted(k for k, v in state.items() if torch.is_tensor(v) and v.numel() == param.numel() and v.dim() > 0)


class NvmeOptimizerSwapper:
    def __init__(
        self,
        file: SwapFile,
        buffer_count: int,
        max_numel: int,
        pin: bool,
        synchronize: Callable[[], None],
    ):
        self.file = file
        self.synchronize = synchronize  # device copies out of a staging buffer finish before it is refilled
        self.max_numel = max_numel
        self.pin = pin
        self.regions: dict[tuple[int, str], tuple[SwapFile, int]] = {}  # (id(param), key) -> file and offset
        self.state_keys: dict[int, list[str]] = {}  # id(param) -> its swapped optimizer state keys
        self.slots = [_Slot() for _ in range(buffer_count)]
        self.twins: dict[tuple[int, str], tuple[SwapFile, int]] = {}  # the regions a speculated step writes
        self._spill_slots = self.slots  # the slots gradients stage through (their own once shadowed)
        self._spill_turn = 0  # the slot the next gradient write stages through
        self._grad_writes: dict[int, list[IOPending]] = {}  # id(sub.param) -> its last gradient write
        self._handoff: Optional[BufferPool] = None  # with shadows: final gradients kept for the step to take them
        self._handed: dict[int, torch.Tensor] = {}  # id(sub.param) -> its hand-off buffer, until a step takes it
        # speculation, per id(sub.param): (the sub-group, its state before, its state keys before) while a shadow step
        # runs; then (the state the step made, the keys before) until commit or discard
        self._set_aside: dict[int, tuple[SubGroup, Optional[dict], list[str]]] = {}
        self._speculated: dict[int, tuple[Optional[dict], list[str]]] = {}
        self._stepping: Optional[tuple[SubGroup, _Slot]] = None  # the sub-group ``steps`` has yielded, and its slot

    # -- staging buffers and file regions -------------------------------------------------------
    def _view(self, slot: _Slot, key: str, numel: int) -> torch.Tensor:
        if key not in slot.buffers:
            slot.buffers[key] = aligned_empty(self.max_numel * 4, self.pin)
        return slot.buffers[key][: numel * 4].view(torch.float32)

    def _io(self, write: bool, sub: SubGroup, slot: _Slot, keys: list[str], shadow: bool = False) -> list[IOPending]:
        pendings = []
        for key in keys:
            region = (id(sub.param), key)
            if region not in self.regions:
                self.reserve(sub, key)
            if key not in (MASTER, GRAD) and key not in self.state_keys.setdefault(id(sub.param), []):
                self.state_keys[id(sub.param)].append(key)  # a region kept from a discarded speculation
            buffer = slot.buffers[key][: align_up(sub.numel * 4)]
            file, offset = self.twins[region] if shadow and key != GRAD else self.regions[region]
            pendings.append(file.submit(write, buffer, offset))
        return pendings

    def reserve(self, sub: SubGroup, key: str) -> None:
        """Claim the sub-group's region for ``key`` in the file now (a full disk fails here, not mid-step); with
        shadows, its twin too."""
        self.regions[(id(sub.param), key)] = (self.file, self.file.reserve(sub.numel * 4))
        if self.shadowed and key != GRAD:
            self.twins[(id(sub.param), key)] = (self.file, self.file.reserve(sub.numel * 4))

    @property
    def shadowed(self) -> bool:
        return self._spill_slots is not self.slots

    def enable_shadow(self, subs: list[SubGroup]) -> None:
        """Give every region but the gradients' a twin (reserved now: a disk too small fails here, naming the
        bytes), and the gradients their own two staging slots."""
        if self.shadowed:
            return
        self._spill_slots = [_Slot(), _Slot()]
        for sub in subs:
            for key in self._keys(sub):
                if (id(sub.param), key) in self.regions:
                    self.twins[(id(sub.param), key)] = (self.file, self.file.reserve(sub.numel * 4))

    def commit(self, sub: SubGroup, optimizer: torch.optim.Optimizer) -> tuple[SwapFile, int]:
        """Make what a speculated step of ``sub`` wrote current: its regions (the old ones become the next twins)
        and ``optimizer``'s scalar state for it; returns where its master weights now are."""
        state, _ = self._speculated.pop(id(sub.param))
        for key in self._keys(sub):
            region = (id(sub.param), key)
            self.regions[region], self.twins[region] = self.twins[region], self.regions[region]
        if state is not None:
            optimizer.state[sub.param] = state
        return self.regions[(id(sub.param), MASTER)]

    def discard(self, sub: SubGroup) -> None:
        """Forget a speculated step of ``sub``: the current regions and the optimizer's state are as before it
        (the state keys its first step added are dropped again)."""
        speculated = self._speculated.pop(id(sub.param), None)
        if speculated is not None:
            self.state_keys[id(sub.param)] = speculated[1]

    def share(self, sub: SubGroup, key: str, file: SwapFile, offset: int) -> None:
        """Keep the sub-group's ``key`` in a region of another swap file (an fp32 parameter shard that is its own
        master: the step's write of the master is the shard's update)."""
        self.regions[(id(sub.param), key)] = (file, offset)

    def _keys(self, sub: SubGroup) -> list[str]:
        return [MASTER, *self.state_keys.get(id(sub.param), [])]

    def finish_writes(self) -> None:
        """Wait for every write behind (so a read of any region sees it)."""
        for slot in self.slots:
            slot.finish_writes()
        self.finish_spills()

    def finish_spills(self) -> None:
        """Wait for the gradient writes behind in their own slots (once shadowed; a step reading a sub-group's
        gradient waits for that one's write alone, ``_read``)."""
        if self.shadowed:
            for slot in self._spill_slots:
                slot.finish_writes()

    def bytes_on_disk(self) -> int:
        return self.file.size

    def bytes_in_memory(self) -> int:
        slots = self.slots + (self._spill_slots if self.shadowed else [])
        handoff = self._handoff.bytes_in_memory if self._handoff is not None else 0
        return handoff + sum(b.numel() for slot in slots for b in list(slot.buffers.values()))  # a step may be adding

    # -- moving one sub-group in and out ----------------------------------------------------------
    def _read(self, sub: SubGroup, slot: _Slot, with_grad: bool) -> None:
        slot.finish_writes()
        handed = self._handed.pop(id(sub.param), None) if with_grad else None
        if with_grad and handed is None:
            for pending in self._grad_writes.pop(id(sub.param), []):
                pending.wait()  # its gradient is in the file (written by the training thread, maybe in flight)
        self.synchronize()
        keys = self._keys(sub) + ([GRAD] if with_grad and handed is None else [])
        for key in keys + ([GRAD] if handed is not None else []):
            self._view(slot, key, sub.numel)
        if handed is not None:  # the gradient from memory, as the training thread wrote it: not read back
            self._view(slot, GRAD, sub.numel).copy_(handed[: sub.numel * 4].view(torch.float32))
            self._handoff.give_back(handed, self._grad_writes.get(id(sub.param), [None])[0])
        pendings = self._io(False, sub, slot, keys)
        slot.reading = IOPending.all_of(pendings)

    def _bind(self, optimizer: torch.optim.Optimizer, sub: SubGroup, slot: _Slot, shadow: bool = False) -> None:
        """Point the sub-group's parameter and state at the slot's buffers; ``shadow``: at a copy of its state
        (scalars cloned: the optimizer increments its step count in place), the original set aside unchanged."""
        slot.reading.wait()
        slot.reading = None
        sub.param.data = self._view(slot, MASTER, sub.numel)
        self._stepping = (sub, slot)
        state = optimizer.state.get(sub.param)
        if shadow:
            self._set_aside[id(sub.param)] = (sub, state, list(self.state_keys.get(id(sub.param), [])))
            if state:
                state = {k: v.clone() if torch.is_tensor(v) and v.dim() == 0 else v for k, v in state.items()}
                optimizer.state[sub.param] = state
        if state:
            for key in self._keys(sub)[1:]:
                state[key] = self._view(slot, key, sub.numel)

    def _unbind_and_write(
        self, optimizer: torch.optim.Optimizer, sub: SubGroup, slot: _Slot, shadow: bool = False
    ) -> None:
        state = optimizer.state.get(sub.param, {})
        keys = elementwise_keys(state, sub.param)
        for key in keys:
            view = self._view(slot, key, sub.numel)
            if state[key].data_ptr() != view.data_ptr():  # created by the optimizer on its first step
                view.copy_(state[key].reshape(-1))
            state[key] = _SWAPPED_OUT
        slot.writing = self._io(True, sub, slot, [MASTER, *keys], shadow)
        sub.param.data = _SWAPPED_OUT
        self._stepping = None
        if shadow:  # the speculated state waits for the verdict; the optimizer holds the original again
            self._speculated[id(sub.param)] = (optimizer.state.get(sub.param), self._put_back(optimizer, sub))

    def _put_back(self, optimizer: torch.optim.Optimizer, sub: SubGroup) -> list[str]:
        """The optimizer's state of ``sub`` as it was before its shadow step (returns its state keys then)."""
        _, before, keys_before = self._set_aside.pop(id(sub.param))
        if before is None:
            optimizer.state.pop(sub.param, None)
        else:
            optimizer.state[sub.param] = before
        return keys_before

    def staged_grad(self, sub: SubGroup) -> torch.Tensor:
        """The gradient ``steps(..., with_grad=...)`` read with the sub-group it has just yielded (scratch: the
        step may scale it in place)."""
        if self._stepping is None or self._stepping[0] is not sub:
            raise AssertionError("staged_grad is valid for the sub-group steps() has yielded")
        return self._view(self._stepping[1], GRAD, sub.numel)

    def steps(
        self,
        optimizer: torch.optim.Optimizer,
        subs: list[SubGroup],
        with_grad: frozenset[int] = frozenset(),
        written: Optional[Callable[[SubGroup], None]] = None,
        into_shadow: bool = False,
    ) -> Iterator[SubGroup]:
        """Yield each sub-group with its master weights and ``optimizer``'s state for it in memory (and, for those
        whose ``id(sub.param)`` is in ``with_grad``, its gradient: :meth:`staged_grad`), reading ahead up to
        ``buffer_count - 1`` sub-groups and writing each back as soon as it has been stepped (``into_shadow``: to
        the twins, see the module docstring); ``written`` is called with each sub-group once its writes are
        submitted (a later read of its regions, from any thread, sees them)."""
        for slot in self.slots:  # the gradients each sub-group reads land first too (``_read``)
            slot.finish_writes()
        ahead = max(1, len(self.slots) - 1)
        free = deque(self.slots)
        queued: deque[tuple[SubGroup, _Slot]] = deque()
        issued = 0
        try:
            for sub in subs:
                while issued < len(subs) and len(queued) < ahead and free:
                    slot = free.popleft()
                    self._read(subs[issued], slot, id(subs[issued].param) in with_grad)
                    queued.append((subs[issued], slot))
                    issued += 1
                current, slot = queued.popleft()
                if current is not sub:
                    raise AssertionError("sub-groups must be stepped in the order they were read")
                self._bind(optimizer, sub, slot, into_shadow)
                yield sub
                self._unbind_and_write(optimizer, sub, slot, into_shadow)
                free.append(slot)
                if written is not None:
                    written(sub)
        finally:
            for sub, *_ in list(self._set_aside.values()):  # a shadow step that failed half-way
                sub.param.data = _SWAPPED_OUT
                self.state_keys[id(sub.param)] = self._put_back(optimizer, sub)
                self._stepping = None
            for slot in self.slots:
                if slot.reading is not None:
                    slot.reading.wait()
                    slot.reading = None
                slot.finish_writes()

    # -- whole-sub-group access (initialization, checkpoints, GatheredParameters) ----------------
    def read(self, sub: SubGroup, keys: Optional[list[str]] = None) -> dict[str, torch.Tensor]:
        """Copies of the sub-group's master weights and elementwise state (or of the given keys)."""
        slot = self.slots[0]
        slot.finish_writes()
        self.synchronize()
        keys = keys or self._keys(sub)
        for key in keys:
            self._view(slot, key, sub.numel)
        for pending in self._io(False, sub, slot, keys):
            pending.wait()
        return {key: self._view(slot, key, sub.numel).clone() for key in keys}

    def write_grad(self, sub: SubGroup, values: torch.Tensor, final: bool = False) -> None:
        """Write the sub-group's gradient behind: staged in the slots in turn, so at most ``buffer_count`` writes
        are in flight and the caller's ``values`` are free to reuse at once. ``final`` (the step's gradient) with
        shadows on: staged in a hand-off buffer when one is free, which the next step to read the sub-group's
        gradient (the one during backward, as a rule) takes from memory instead of reading it back (Note [gradient
        hand-off])."""
        stale = self._handed.pop(id(sub.param), None)  # a hand-off no step took (a skipped step's)
        if stale is not None:
            self._handoff.give_back(stale, self._grad_writes.get(id(sub.param), [None])[0])
        if final and self.shadowed and self._handoff is None:  # made with the first: only spilled gradients use it
            self._handoff = BufferPool(len(self.slots) + 1, self.max_numel * 4, self.pin)  # one is kept back
            for spilling in self._spill_slots:  # the fallback's buffers now too: host memory fixed from here on
                self._view(spilling, GRAD, self.max_numel)
        if final and self.shadowed and (buffer := self._handoff.try_acquire()) is not None:
            buffer[: sub.numel * 4].view(torch.float32).copy_(values)
            file, offset = self.regions[(id(sub.param), GRAD)]
            self._grad_writes[id(sub.param)] = [file.submit(True, buffer[: align_up(sub.numel * 4)], offset)]
            self._handed[id(sub.param)] = buffer
            return
        slot = self._spill_slots[self._spill_turn]
        self._spill_turn = (self._spill_turn + 1) % len(self._spill_slots)
        slot.finish_writes()
        self._view(slot, GRAD, sub.numel).copy_(values)
        pendings = self._io(True, sub, slot, [GRAD])
        slot.writing.extend(pendings)
        self._grad_writes[id(sub.param)] = pendings

    def read_grad(self, sub: SubGroup, out: torch.Tensor) -> None:
        """Read the sub-group's gradient into ``out`` (synchronously: an accumulation's next micro-batch)."""
        for spilling in self._spill_slots:
            spilling.finish_writes()
        for pending in self._grad_writes.get(id(sub.param), []):
            pending.wait()  # written from a hand-off buffer
        slot = self._spill_slots[0]
        self._view(slot, GRAD, sub.numel)
        for pending in self._io(False, sub, slot, [GRAD]):
            pending.wait()
        out.copy_(self._view(slot, GRAD, sub.numel))

    def write(self, sub: SubGroup, tensors: dict[str, torch.Tensor]) -> None:
        """Replace the sub-group's master weights and/or elementwise state (synchronously)."""
        slot = self.slots[0]
        slot.finish_writes()
        for key, value in tensors.items():
            self._view(slot, key, sub.numel).copy_(value.reshape(-1))
        for pending in self._io(True, sub, slot, list(tensors)):
            pending.wait()
