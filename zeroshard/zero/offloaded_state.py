"""The optimizer state off the compute device.

- :class:`HostState` (``offload_optimizer.device: cpu``): in (pinned) host memory, cut into sub-groups of at
  most ``sub_group_size`` elements stepped one at a time, each one's update copied to the compute parameters
  while the next is stepped.
- :class:`NvmeState` (``offload_optimizer.device: nvme``): as the host state, but the sub-groups live in a
  swap file and stream through a few host buffers around their turn (:mod:`zeroshard.offload`).

Both can run their step behind the next forward (:meth:`HostState.step_behind`, :mod:`.step_behind`), or during
backward, before its verdict, into shadow slots (:meth:`HostState.speculate`, :mod:`.speculation`). Under
``offload_optimizer.ratio`` some flat groups stay on the compute device (``kept``: master, gradient and state there,
stepped as :class:`~.optimizer_state.DeviceState` steps them). :mod:`.optimizer_home` picks the home
``offload_optimizer`` names, the flat groups kept, and whether the step runs during backward.
"""

from __future__ import annotations

import os
import shutil
from typing import Callable, Iterable, Optional

import torch

from .. import comm
from ..accelerator import copy_across
from ..offload import (
    MASTER,
    NvmeShard,
    OffloadIOError,
    OffloadPlan,
    SubGroup,
    optimizer_swapper,
)
from ..offload.aio import align_up
from ..optim.contract import ShardLayout, needs_of
from .buffers import ReusableBuffers
from .flat_group import FlatGroup
from .grad_home import GradHome, ResidentGrad, SpilledGrad
from .optimizer_state import OptimizerState, copied, device_master
from .speculation import Speculation
from .step_behind import StepBehind, frozen_groups


class HostState(OptimizerState):
    """See the module docstring. ``kept``: the flat groups ``offload_optimizer.ratio`` keeps on the compute device
    (master, state and gradient there, one sub-group each, stepped right after the verdict as :class:`DeviceState`
    steps them); the others are offloaded."""

    location = "host"

    def __init__(self, *args, sub_group_size: int, pin_memory: bool, kept: frozenset[int] = frozenset(), **kwargs):
        self.sub_group_size = sub_group_size
        self.pin_memory = pin_memory
        self.kept = kept
        self.shadow_budget: Optional[int] = None  # bytes of host shadows speculation may hold (None: no bound)
        self.shadow_bytes = 0  # bytes of host shadows allocated
        self._shadows: dict[int, tuple[torch.Tensor, Optional[dict]]] = {}  # id(sub.param) -> speculated step
        self._spares: dict[int, dict[str, torch.Tensor]] = {}  # id(sub.param) -> buffers for its next shadow
        super().__init__(*args, **kwargs)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def _ranges(self, numel: int) -> list[tuple[int, int]]:
        return [(start, min(start + self.sub_group_size, numel)) for start in range(0, numel, self.sub_group_size)]

    def _subgroups(self, index: int, flat: FlatGroup) -> list[SubGroup]:
        numel = flat.layout.shard_numel
        if index in self.kept:
            return [SubGroup(index, 0, numel, device_master(flat, self.master_dtype))]
        master = torch.empty(numel, dtype=self.master_dtype, pin_memory=self.pin_memory)
        copy_across(master, flat.shard_values(), to_host=True)
        return [SubGroup(index, start, stop, master[start:stop]) for start, stop in self._ranges(numel)]

    def _ordered(
        self, grads: list[GradHome], subs: list[SubGroup], optimizer: torch.optim.Optimizer
    ) -> Iterable[SubGroup]:
        return subs

    def _grad_of(self, sub: SubGroup, home: GradHome) -> torch.Tensor:
        return home.read()[sub.start : sub.stop]

    def _layout(self) -> Optional[ShardLayout]:
        """The layout while each flat group's shard is one sub-group (sub_group_size is 1e9 by default)."""
        whole = all(len(subs) == 1 for subs in self._subgroups_of)
        return super()._layout() if whole else None

    def step(
        self,
        grads: list[GradHome],
        coef: float = 1.0,
        order: Optional[list[int]] = None,
        optimizer: Optional[torch.optim.Optimizer] = None,
    ) -> None:
        """One sub-group at a time on the CPU; each update's copy to the compute parameters is issued
        (non-blocking) before the next sub-group is stepped. ``order``: the flat groups to step, in this order
        (all, in their order, by default); ``optimizer``: the handle to step through (:func:`.frozen_groups`)."""
        optimizer = optimizer or self.optimizer
        subs = self.subgroups if order is None else [sub for k in order for sub in self._subgroups_of[k]]
        for sub in [sub for sub in subs if sub.flat_index in self.kept]:  # on the device, first: it is fast
            sub.param.grad = self._master_grad(grads[sub.flat_index].read(), coef)
            optimizer.step()
            sub.param.grad = None
            self._write_back(sub, sub.param.detach())
        for sub in self._ordered(grads, [sub for sub in subs if sub.flat_index not in self.kept], optimizer):
            sub.param.grad = self._master_grad(self._grad_of(sub, grads[sub.flat_index]), coef)
            optimizer.step()
            sub.param.grad = None
            self._stepped(sub)

    def grad_home(self, index: int, dtype: torch.dtype, pin: bool, buffers: ReusableBuffers) -> GradHome:
        if index not in self.kept:
            return super().grad_home(index, dtype, pin, buffers)
        flat = self.flats[index]
        home = ResidentGrad.zeros(flat.layout.shard_numel, dtype, flat.device, False, "device")
        self._grad_homes[index] = home
        return home

    def _location_of(self, sub: SubGroup) -> str:
        return "device" if sub.flat_index in self.kept else self.location

    def _stepped(self, sub: SubGroup) -> None:
        """``sub`` has just been stepped: its update goes to the compute parameters."""
        self._write_back(sub, sub.param.detach())

    @property
    def can_step_behind(self) -> bool:
        # the CPU's step hides behind the device's forward; where the CPU is the compute device they would take
        # turns on the same cores (measured: 2.86 -> 3.25 s per step, 210M GPT, 2 ranks on 2 cores)
        return bool(self.flats) and self.flats[0].device.type != "cpu"

    def step_behind(
        self, grads: list[GradHome], coef: float, order: list[int], then: Callable[[], None], label: str
    ) -> None:
        """:meth:`step` over every flat group, the forward's first ones first (``order``), on the worker thread
        (:mod:`.step_behind`), then ``then`` there (the gradients' clearing). The resident flat groups are stepped
        here first: their publish is a collective, which only the training thread issues."""
        self.settle()
        if self.behind is None:
            self.behind = StepBehind(comm.get_rank())
        resident = [k for k in order if self.flats[k].resident]
        if resident:
            self.step(grads, coef, resident)
        rest = [k for k in order if not self.flats[k].resident]
        frozen = frozen_groups(self.optimizer)  # the hyperparameters of now, whatever a scheduler does next

        def work() -> None:
            self.step(grads, coef, rest, frozen)
            then()

        self.behind.launch(label, work, [self.flats[k] for k in rest])

    # -- the step during backward (:mod:`.speculation`) ----------------------------------------------
    def enable_speculation(self, speculation: Speculation, shadow_budget: Optional[int]) -> None:
        """Step flat groups during backward, into shadows of at most ``shadow_budget`` bytes of host memory (None:
        as many as the state; a flat group that does not fit is stepped after the verdict)."""
        self.speculation, self.shadow_budget = speculation, shadow_budget

    def speculate(self, index: int, coef: float, optimizer: torch.optim.Optimizer) -> Optional[int]:
        home, subs = self._grad_homes[index], self._subgroups_of[index]
        if index in self.kept or not self._room_for_shadows(subs, optimizer):
            return None  # kept on the device: stepped right after the verdict
        try:
            for sub in self._shadowed(subs, home, optimizer):
                sub.param.grad = self._master_grad(self._speculative_grad(sub, home), coef)
                optimizer.step()
                sub.param.grad = None
        except BaseException:
            for sub in subs:
                sub.param.grad = None
            self.discard(index)  # the sub-groups it had stepped; the state they came from is untouched
            raise
        return len(subs)

    def _speculative_grad(self, sub: SubGroup, home: GradHome) -> torch.Tensor:
        """The gradient range as the step reads it, in a copy: the replay needs the original."""
        return self._grad_of(sub, home).to(self.master_dtype, copy=True)

    def _room_for_shadows(self, subs: list[SubGroup], optimizer: torch.optim.Optimizer) -> bool:
        if self.shadow_budget is None:
            return True
        need = 0
        for sub in subs:
            spare = self._spares.get(id(sub.param), {})
            state = optimizer.state.get(sub.param) or {}
            values = {MASTER: sub.param, **{k: v for k, v in state.items() if _elementwise(v, sub)}}
            need += sum(v.numel() * v.element_size() for k, v in values.items() if k not in spare)
        return self.shadow_bytes + need <= self.shadow_budget

    def _shadowed(self, subs: list[SubGroup], home: GradHome, optimizer: torch.optim.Optimizer):
        """Yield each sub-group with its parameter and state pointed at copies (its shadow), then point them back
        and keep the shadow for the verdict."""
        for sub in subs:
            master, state = sub.param.data, optimizer.state.get(sub.param)
            spare = self._spares.pop(id(sub.param), {})
            sub.param.data = self._copy_into(spare.get(MASTER), master)
            if state is not None:
                optimizer.state[sub.param] = {
                    key: self._copy_into(spare.get(key), v) if _elementwise(v, sub) else _cloned(v)
                    for key, v in state.items()
                }
            try:
                yield sub
            finally:
                self._shadows[id(sub.param)] = (sub.param.data, optimizer.state.get(sub.param))
                sub.param.data = master
                if state is None:
                    optimizer.state.pop(sub.param, None)
                else:
                    optimizer.state[sub.param] = state

    def _copy_into(self, buffer: Optional[torch.Tensor], values: torch.Tensor) -> torch.Tensor:
        if buffer is None or buffer.shape != values.shape or buffer.dtype != values.dtype:
            buffer = torch.empty(values.shape, dtype=values.dtype, pin_memory=self.pin_memory)
            self.shadow_bytes += buffer.numel() * buffer.element_size()
        return buffer.copy_(values)

    def commit(self, index: int) -> None:
        """The speculated steps of flat group ``index`` become its state (the old buffers the next shadows), and
        its parameters are published."""
        for sub in self._subgroups_of[index]:
            master, state = self._shadows.pop(id(sub.param))
            self._spares[id(sub.param)] = self._buffers_of(sub, sub.param.data, self.optimizer.state.get(sub.param))
            sub.param.data = master
            if state is None:
                self.optimizer.state.pop(sub.param, None)
            else:
                self.optimizer.state[sub.param] = state
            self._stepped(sub)

    def discard(self, index: int) -> None:
        """Drop the speculated steps of flat group ``index`` (those it has: a failed one stopped half-way)."""
        for sub in self._subgroups_of[index]:
            if (shadow := self._shadows.pop(id(sub.param), None)) is not None:
                self._spares[id(sub.param)] = self._buffers_of(sub, *shadow)

    def _buffers_of(self, sub: SubGroup, master: torch.Tensor, state: Optional[dict]) -> dict[str, torch.Tensor]:
        return {MASTER: master, **{k: v for k, v in (state or {}).items() if _elementwise(v, sub)}}

    def bytes_held(self) -> dict[str, dict[str, int]]:
        held = super().bytes_held()
        held["optimizer_state"]["host"] = held["optimizer_state"].get("host", 0) + self.shadow_bytes
        return held


def _elementwise(value, sub: SubGroup) -> bool:
    return torch.is_tensor(value) and value.dim() > 0 and value.numel() == sub.numel


def _cloned(value):
    return value.clone() if torch.is_tensor(value) else value


class NvmeState(HostState):
    """Master weights and elementwise optimizer state in a swap file (see ``NvmeOptimizerSwapper``)."""

    location = "host"

    def __init__(self, flats: list[FlatGroup], *args, offload: OffloadPlan, synchronize: Callable[[], None], **kwargs):
        kept = kwargs.get("kept", frozenset())
        largest = max((flat.layout.shard_numel for k, flat in enumerate(flats) if k not in kept), default=1)
        self.swapper = optimizer_swapper(offload, min(largest, offload.sub_group_size), synchronize)
        self._master_is_shard: set[int] = set()  # id(sub.param) of the sub-groups whose master is the shard
        super().__init__(flats, *args, sub_group_size=offload.sub_group_size, pin_memory=offload.pin_memory, **kwargs)
        if any(self.optimizer.state.values()):
            raise ValueError(
                f"{type(self.optimizer).__name__} creates its state when constructed, which NVMe offload "
                "cannot swap; with offload_optimizer.device 'nvme' use Adam, AdamW, Lion or SGD"
            )

    def _subgroups(self, index: int, flat: FlatGroup) -> list[SubGroup]:
        """The master leaves memory here: one flat group's fp32 values at a time go to the swap file. An fp32 shard
        on NVMe that is one sub-group *is* its master: the sub-group keeps its master in the shard's region (the
        step's write of it updates the parameter), 4 bytes per element less on disk and per step."""
        if index in self.kept:
            return super()._subgroups(index, flat)
        ranges = self._ranges(flat.layout.shard_numel)
        if isinstance(flat.home, NvmeShard) and flat.dtype == self.master_dtype and len(ranges) == 1:
            sub = SubGroup(index, *ranges[0], torch.empty(0))
            self.swapper.share(sub, MASTER, *flat.home.share_as_master())
            self._master_is_shard.add(id(sub.param))
            return [sub]
        values = flat.shard_values()
        subs = []
        for start, stop in ranges:
            sub = SubGroup(index, start, stop, torch.empty(0))  # data only while in a staging buffer
            self.swapper.write(sub, {MASTER: values[start:stop].to(self.master_dtype)})
            subs.append(sub)
        return subs

    def grad_home(self, index: int, dtype: torch.dtype, pin: bool, buffers: ReusableBuffers) -> GradHome:
        """The gradient shard goes where the parameter shard is: in the swap file, beside the master weights
        (:class:`~.grad_home.SpilledGrad`), when the parameter shard lives on NVMe (the run keeps the model out of
        RAM: ``offload_param`` nvme beyond ``max_in_cpu``); in host memory otherwise, where the parameters already
        take model-sized room and the step reads 4 bytes per parameter less. In memory also for an optimizer that
        exchanges its own gradients (1-bit: each rank keeps its whole gradient between steps)."""
        exact = needs_of(self.optimizer).gradient_exchange == "exact"
        if not exact or not isinstance(self.flats[index].home, NvmeShard) or index in self.kept:
            return super().grad_home(index, dtype, pin, buffers)
        home = self._grad_homes[index] = SpilledGrad(self._subgroups_of[index], self.swapper, buffers, dtype)
        return home

    @property
    def can_step_behind(self) -> bool:
        # the step mostly waits on the disk while the forward computes (shards on NVMe included: the forward reads
        # each one once the step has written it, through the staging pool and swap file both threads share)
        return True

    def _ordered(self, grads: list[GradHome], subs: list[SubGroup], optimizer: torch.optim.Optimizer):
        on_disk = frozenset(id(sub.param) for sub in subs if isinstance(grads[sub.flat_index], SpilledGrad))
        return self.swapper.steps(optimizer, subs, with_grad=on_disk, written=self._written)

    def _stepped(self, sub: SubGroup) -> None:
        if id(sub.param) not in self._master_is_shard:
            super()._stepped(sub)
        # else the swapper's write of the master is the shard's update: published once submitted (``_written``)

    def _written(self, sub: SubGroup) -> None:
        if id(sub.param) in self._master_is_shard:
            self._write_back(sub, sub.param.detach())  # the home drops any staged copy; the flat group is published

    def _grad_of(self, sub: SubGroup, home: GradHome) -> torch.Tensor:
        if not isinstance(home, SpilledGrad):
            return super()._grad_of(sub, home)
        staged = self.swapper.staged_grad(sub)
        return staged.zero_() if home.empty else staged  # read with the sub-group; zero when nothing was written

    def _layout(self) -> Optional[ShardLayout]:
        return None  # the master tensors exist only while a sub-group is staged

    def enable_speculation(self, speculation: Speculation, shadow_budget: Optional[int]) -> None:
        """Shadows are twin regions of the swap file (twice the optimizer's disk space), not host memory:
        ``shadow_budget`` does not apply. The masters' twins are reserved now; the moments' regions, both copies,
        with the first step, so the disk must have room for them now: else this is refused, naming the bytes."""
        offloaded = [sub for sub in self.subgroups if sub.flat_index not in self.kept]
        per_key = sum(align_up(sub.numel * 4) for sub in offloaded)
        self.swapper.enable_shadow(offloaded)
        need = 2 * self.state_keys_per_element() * per_key
        directory = os.path.dirname(self.swapper.file.path)
        free = shutil.disk_usage(directory).free
        if need > free:
            self.swapper.file.close()  # its reserved space goes back now, not when a collector finds this state
            raise OffloadIOError(
                f"offload_optimizer.super_offload: the optimizer state needs {need} more bytes in {directory} "
                f"(its moments and their twins, which the step during backward writes), and the disk has {free} "
                "free: free space, point nvme_path at a larger disk, or set super_offload to false (half the bytes)"
            )
        self.speculation = speculation

    def _speculative_grad(self, sub: SubGroup, home: GradHome) -> torch.Tensor:
        if isinstance(home, SpilledGrad):
            return self._grad_of(sub, home)  # staged with the sub-group: a copy already
        return super()._speculative_grad(sub, home)

    def _room_for_shadows(self, subs: list[SubGroup], optimizer: torch.optim.Optimizer) -> bool:
        return True

    def _shadowed(self, subs: list[SubGroup], home: GradHome, optimizer: torch.optim.Optimizer):
        with_grad = frozenset(id(sub.param) for sub in subs) if isinstance(home, SpilledGrad) else frozenset()
        return self.swapper.steps(optimizer, subs, with_grad=with_grad, into_shadow=True)

    def commit(self, index: int) -> None:
        for sub in self._subgroups_of[index]:
            file, offset = self.swapper.commit(sub, self.optimizer)
            if id(sub.param) in self._master_is_shard:
                self.flats[index].home.master_moved(file, offset)
                self._write_back(sub, sub.param.detach())  # nothing to copy: the home reads the new region
            else:
                self._write_back(sub, self._master_values(sub))

    def discard(self, index: int) -> None:
        for sub in self._subgroups_of[index]:
            self.swapper.discard(sub)

    def _master_values(self, sub: SubGroup) -> torch.Tensor:
        if sub.flat_index in self.kept:
            return super()._master_values(sub)
        return self.swapper.read(sub, [MASTER])[MASTER]

    def state_keys(self, index: int) -> list[str]:
        if index in self.kept:
            return super().state_keys(index)
        self.settle()
        return sorted(self.swapper.state_keys.get(id(self._subgroups_of[index][0].param), []))

    def _read_sub(self, sub: SubGroup) -> dict[str, torch.Tensor]:
        return super()._read_sub(sub) if sub.flat_index in self.kept else self.swapper.read(sub)

    def _write_sub(self, sub: SubGroup, part: dict[str, torch.Tensor], scalars: dict) -> None:
        if sub.flat_index in self.kept:
            return super()._write_sub(sub, part, scalars)
        self.swapper.write(sub, part)
        if len(part) > 1:
            self.optimizer.state[sub.param] = copied(scalars)

    def swap_files(self) -> list:
        return [self.swapper.file]

    def _location_of(self, sub: SubGroup) -> str:
        return "device" if sub.flat_index in self.kept else "nvme"

    def _master_bytes_of(self, sub: SubGroup) -> int:
        """On disk: a master that is the parameter shard is counted once, as parameters (as on the device); a
        twin (the step during backward's) is counted."""
        if sub.flat_index in self.kept:
            return super()._master_bytes_of(sub)
        own = 0 if id(sub.param) in self._master_is_shard else sub.numel * 4
        return own + (sub.numel * 4 if (id(sub.param), MASTER) in self.swapper.twins else 0)

    def _state_bytes_of(self, sub: SubGroup) -> int:
        if sub.flat_index in self.kept:
            return super()._state_bytes_of(sub)
        keys = self.swapper.state_keys.get(id(sub.param), [])
        return sub.numel * 4 * sum(1 + ((id(sub.param), key) in self.swapper.twins) for key in keys)

    def bytes_held(self) -> dict[str, dict[str, int]]:
        held = super().bytes_held()
        held["optimizer_state"]["host"] = held["optimizer_state"].get("host", 0) + self.swapper.bytes_in_memory()
        return held
