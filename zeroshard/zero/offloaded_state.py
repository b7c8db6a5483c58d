"""The optimizer state off the compute device, and the choice of home.

- :class:`HostState` (``offload_optimizer.device: cpu``): in (pinned) host memory, cut into sub-groups of at
  most ``sub_group_size`` elements stepped one at a time, each one's update copied to the compute parameters
  while the next is stepped.
- :class:`NvmeState` (``offload_optimizer.device: nvme``): as the host state, but the sub-groups live in a
  swap file and stream through a few host buffers around their turn (:mod:`zeroshard.offload`).

Both can run their step behind the next forward (:meth:`HostState.step_behind`, :mod:`.step_behind`).
:func:`build_optimizer_state` picks the home ``offload_optimizer`` names, :class:`~.optimizer_state.DeviceState`
included.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping, Optional

import torch

from .. import comm
from ..offload import MASTER, NvmeShard, OffloadPlan, SubGroup, optimizer_swapper
from ..optim.contract import ShardLayout, needs_of
from .buffers import ReusableBuffers
from .flat_group import FlatGroup
from .grad_home import GradHome, SpilledGrad
from .optimizer_state import DeviceState, MakeOptimizer, OptimizerState, copied
from .step_behind import StepBehind, frozen_groups


class HostState(OptimizerState):
    location = "host"

    def __init__(self, *args, sub_group_size: int, pin_memory: bool, **kwargs):
        self.sub_group_size = sub_group_size
        self.pin_memory = pin_memory
        super().__init__(*args, **kwargs)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def _ranges(self, numel: int) -> list[tuple[int, int]]:
        return [(start, min(start + self.sub_group_size, numel)) for start in range(0, numel, self.sub_group_size)]

    def _subgroups(self, index: int, flat: FlatGroup) -> list[SubGroup]:
        numel = flat.layout.shard_numel
        master = torch.empty(numel, dtype=self.master_dtype, pin_memory=self.pin_memory)
        master.copy_(flat.shard_values())
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
        for sub in self._ordered(grads, subs, optimizer):
            sub.param.grad = self._master_grad(self._grad_of(sub, grads[sub.flat_index]), coef)
            optimizer.step()
            sub.param.grad = None
            self._stepped(sub)

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


class NvmeState(HostState):
    """Master weights and elementwise optimizer state in a swap file (see ``NvmeOptimizerSwapper``)."""

    location = "host"

    def __init__(self, flats: list[FlatGroup], *args, offload: OffloadPlan, synchronize: Callable[[], None], **kwargs):
        largest = max((flat.layout.shard_numel for flat in flats), default=1)
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
        if not exact or not isinstance(self.flats[index].home, NvmeShard):
            return super().grad_home(index, dtype, pin, buffers)
        return SpilledGrad(self._subgroups_of[index], self.swapper, buffers, dtype)

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

    def _master_values(self, sub: SubGroup) -> torch.Tensor:
        return self.swapper.read(sub, [MASTER])[MASTER]

    def state_keys(self, index: int) -> list[str]:
        self.settle()
        return sorted(self.swapper.state_keys.get(id(self._subgroups_of[index][0].param), []))

    def _read_sub(self, sub: SubGroup) -> dict[str, torch.Tensor]:
        return self.swapper.read(sub)

    def _write_sub(self, sub: SubGroup, part: dict[str, torch.Tensor], scalars: dict) -> None:
        self.swapper.write(sub, part)
        if len(part) > 1:
            self.optimizer.state[sub.param] = copied(scalars)

    def swap_files(self) -> list:
        return [self.swapper.file]

    def bytes_held(self) -> dict[str, dict[str, int]]:
        held = super().bytes_held()
        keys = self.swapper.state_keys
        # a master that is the parameter shard is counted once, as parameters (as on the device)
        held["master"] = {
            "nvme": sum(sub.numel * 4 for sub in self.subgroups if id(sub.param) not in self._master_is_shard)
        }
        held["optimizer_state"]["nvme"] = sum(
            sub.numel * 4 * len(keys.get(id(sub.param), [])) for sub in self.subgroups
        )
        held["optimizer_state"]["host"] += self.swapper.bytes_in_memory()  # the staging buffers
        return held


def build_optimizer_state(
    flats: list[FlatGroup],
    *,
    group_of_flat: list[int],
    param_groups: list[dict],
    make_optimizer: MakeOptimizer,
    master_dtype: torch.dtype,
    offload: OffloadPlan,
    synchronize: Callable[[], None],
    pieces: Optional[Mapping[str, comm.Group]] = None,
) -> OptimizerState:
    """The optimizer state in the home ``offload_optimizer`` names (``pieces``: the group along each split axis,
    over which optimizers that read whole parameters complete them)."""
    args = (flats, group_of_flat, param_groups, make_optimizer)
    if offload.optimizer_device == "nvme":
        return NvmeState(*args, master_dtype=master_dtype, offload=offload, synchronize=synchronize, pieces=pieces)
    if offload.optimizer_device == "cpu":
        return HostState(
            *args,
            master_dtype=master_dtype,
            sub_group_size=offload.sub_group_size,
            pin_memory=offload.pin_memory,
            pieces=pieces,
        )
    return DeviceState(*args, master_dtype=master_dtype, pieces=pieces)
