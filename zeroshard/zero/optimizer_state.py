"""The optimizer's side of ZeRO: fp32 master weights and optimizer state for this rank's shards, one
implementation per home.

- :class:`DeviceState`: on the compute device; the optimizer steps every flat group's master shard in one
  call (one call per flat group when 16-bit gradients need fp32 copies). With fp32 compute the master *is* the
  flat group's shard (no second copy).
- :class:`HostState` (``offload_optimizer.device: cpu``): in (pinned) host memory, cut into sub-groups of at
  most ``sub_group_size`` elements stepped one at a time, each one's update copied to the compute parameters
  while the next is stepped.
- :class:`NvmeState` (``offload_optimizer.device: nvme``): as the host state, but the sub-groups live in a
  swap file and stream through a few host buffers around their turn (:mod:`zeroshard.offload`).

The host and NVMe states can run their step behind the next forward (:meth:`HostState.step_behind`,
:mod:`.step_behind`); every other read or write of the state waits for such a step first (``settle``).

Each owns its sub-groups, the torch optimizer over them, the step, publishing the updated values into the
flat groups, checkpoint reads and writes of one flat group's state, and the byte counts of what it holds.
Gradients come in from the reducer (:mod:`zeroshard.zero.reducer`).
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch

from .. import comm
from ..offload import MASTER, NvmeShard, OffloadPlan, SubGroup, elementwise_keys, optimizer_swapper
from ..optim import ShardedNorms
from .buffers import ReusableBuffers
from .flat_group import FlatGroup
from .grad_home import GradHome, ResidentGrad, SpilledGrad
from .step_behind import StepBehind, frozen_groups

MakeOptimizer = Callable[[list[dict], Optional[ShardedNorms]], torch.optim.Optimizer]


class OptimizerState:
    """What every home shares; subclasses place the master weights (``_subgroups``) and step them (``step``).

    ``group_of_flat[k]`` is the optimizer parameter group of flat group ``k``; ``param_groups`` the groups'
    hyperparameters; ``make_optimizer(master_groups, sharded_norms)`` builds the torch optimizer over the
    master tensors (``sharded_norms`` tells a Lamb which ranges belong to which parameter)."""

    location = "device"  # where the master weights, gradient shards and optimizer state live

    def __init__(
        self,
        flats: list[FlatGroup],
        group_of_flat: list[int],
        param_groups: list[dict],
        make_optimizer: MakeOptimizer,
        master_dtype: torch.dtype,
        tensor: Optional[comm.Group] = None,
    ):
        self.flats = flats
        for flat in flats:
            flat.records.keep(flat, self)
        self.tensor = tensor  # tensor parallelism: the group over which tensor-sharded flat groups hold pieces
        self.group_of_flat = group_of_flat
        self.master_dtype = master_dtype
        self._index = {id(flat): k for k, flat in enumerate(flats)}
        self.subgroups = [sub for k, flat in enumerate(flats) for sub in self._subgroups(k, flat)]
        self._subgroups_of = [[s for s in self.subgroups if s.flat_index == k] for k in range(len(flats))]
        master_groups = [
            {**{key: v for key, v in group.items() if key != "params"}, "params": []} for group in param_groups
        ]
        for sub in self.subgroups:
            master_groups[group_of_flat[sub.flat_index]]["params"].append(sub.param)
        self.optimizer = make_optimizer(master_groups, self._sharded_norms())
        self.behind: Optional[StepBehind] = None  # the worker running a step behind the forward, once one ran

    def settle(self) -> None:
        """Wait for a step running behind the forward, if one is (raising its error if it failed)."""
        if self.behind is not None:
            self.behind.wait()

    @property
    def can_step_behind(self) -> bool:
        """Whether :meth:`step_behind` may run (the host and NVMe states, unless a shard lives on NVMe)."""
        return False

    def close(self) -> None:
        """Finish a step running behind and stop its worker thread."""
        if self.behind is not None:
            self.behind.close()

    @property
    def device(self) -> torch.device:
        return self.flats[0].device if self.flats else torch.device("cpu")

    def _subgroups(self, index: int, flat: FlatGroup) -> list[SubGroup]:
        raise NotImplementedError

    def _sharded_norms(self) -> Optional[ShardedNorms]:
        """Which range of which master shard belongs to which parameter (Lamb's per-parameter trust ratios), and each
        flat group's values made whole (Muon's matrices; gathered on the compute device, where the collectives
        run). Valid while every sub-group is a whole shard; homes that cut shards answer None."""
        segments: dict[int, list[tuple[int, int, int]]] = {}
        slot_id = 0
        for sub in self.subgroups:
            flat = self.flats[sub.flat_index]
            segments[id(sub.param)] = [
                (slot_id + flat.layout.slots.index(seg.slot), seg.shard_start, seg.numel)
                for seg in flat.layout.segments(flat.shard_rank)
            ]
            slot_id += len(flat.layout.slots)
        partitioned = [flat.shard_group for flat in self.flats if flat.partitioned]
        shard_group = partitioned[0] if partitioned else None
        split = torch.tensor([flat.layout.split_axis == "tp" for flat in self.flats for _ in flat.layout.slots])
        pieces = self.tensor if self.tensor is not None and self.tensor.size > 1 and bool(split.any()) else None

        def reduce(squares: torch.Tensor) -> None:
            """Per-parameter sums of squares ([rows, slots]) made whole: over the shard group, then the pieces of
            tensor-parallel parameters over the tensor group (the replicated ones are whole on every rank there)."""
            if shard_group is not None:
                comm.all_reduce(squares, shard_group)
            if pieces is not None:
                mask = split.to(squares.device)
                summed = squares[:, mask].contiguous()
                comm.all_reduce(summed, pieces)
                squares[:, mask] = summed

        flat_of = {id(sub.param): self.flats[sub.flat_index] for sub in self.subgroups}
        matrices = {
            key: [(slot.offset, slot.numel, tuple(slot.shape)) for slot in flat.layout.slots]
            for key, flat in flat_of.items()
        }
        starts = {key: flat.layout.shard_range(flat.shard_rank)[0] for key, flat in flat_of.items()}
        whole = shard_group is None and self.flats and self.flats[0].shard_group.size > 1  # stage 0, several ranks
        return ShardedNorms(
            segments,
            slot_id,
            reduce,
            matrices,
            starts,
            lambda t, v: flat_of[id(t)].whole_of(v.to(flat_of[id(t)].device)),
            compressed=comm.OneBitAllReduce(self.flats[0].shard_group) if whole else None,
        )

    def grad_home(self, index: int, dtype: torch.dtype, pin: bool, buffers: ReusableBuffers) -> GradHome:
        """Where flat group ``index``'s reduced gradient shard waits for the step: beside this state's master weights
        (``dtype``: the policy's gradient dtype; ``buffers``: the engine's reusable ones, for transient work)."""
        numel = self.flats[index].layout.shard_numel
        return ResidentGrad.zeros(numel, dtype, self.device, pin, self.location)

    def step(self, grads: list[GradHome], coef: float = 1.0) -> None:
        """Apply the gradient shards, one per flat group, times ``coef`` (unscaling and clipping), and publish
        the update."""
        raise NotImplementedError

    def _master_grad(self, grad: torch.Tensor, coef: float) -> torch.Tensor:
        """A gradient shard (or a range of it) in the master dtype, times ``coef``: scaled in place when it is
        already (the reducer zeroes it after the step), else a transient copy -- made one flat group or sub-group
        at a time, so 16-bit shards never have fp32 copies of all of them at once (DeepSpeed's stage 3 converts
        per sub-group too)."""
        if grad.dtype != self.master_dtype:
            grad = grad.to(self.master_dtype)
        return grad.mul_(coef) if coef != 1.0 else grad

    # -- publishing into the flat groups -------------------------------------------------------
    def publish(self) -> None:
        """Copy the master weights into the compute parameters (after they were replaced, e.g. by a load)."""
        self.settle()
        for sub in self.subgroups:
            self._write_back(sub, self._master_values(sub))

    def _master_values(self, sub: SubGroup) -> torch.Tensor:
        return sub.param.detach()

    def _write_back(self, sub: SubGroup, values: torch.Tensor) -> None:
        """Updated master values into the compute parameters; a flat group is finished (its offload home
        written, a resident group gathered) with its last sub-group, freeing its staging at once."""
        flat = self.flats[sub.flat_index]
        flat.write_shard(sub.start, values)
        if sub.stop == flat.layout.shard_numel:
            flat.finish_publish()

    def overwrite(self, flat: FlatGroup, values: torch.Tensor) -> None:
        """Replace one flat group's shard, compute and master copies, with new values (``GatheredParameters``
        with a modifier rank)."""
        self.settle()
        flat.write_shard(0, values)
        if flat.home is not None:
            flat.home.flush()
        index = self._index[id(flat)]
        self.write_flat(index, {MASTER: values.to(self.master_dtype)}, {})

    # -- one flat group's state, for checkpoints and state_dict ---------------------------------
    def state_keys(self, index: int) -> list[str]:
        """Names of the elementwise optimizer state tensors of one flat group (e.g. exp_avg, exp_avg_sq)."""
        self.settle()
        first = self._subgroups_of[index][0]
        return elementwise_keys(self.optimizer.state.get(first.param, {}), first.param)

    def scalars(self, index: int) -> dict:
        """The optimizer's non-elementwise state (e.g. step) of one flat group."""
        self.settle()
        first = self._subgroups_of[index][0]
        state = self.optimizer.state.get(first.param, {})
        return {k: v for k, v in state.items() if not (torch.is_tensor(v) and v.dim() > 0)}

    def read_flat(self, index: int) -> dict[str, torch.Tensor]:
        """This rank's whole master shard and elementwise optimizer state of one flat group."""
        self.settle()
        keys = [MASTER, *self.state_keys(index)]
        parts = [self._read_sub(s) for s in self._subgroups_of[index]]
        return {key: parts[0][key] if len(parts) == 1 else torch.cat([p[key] for p in parts]) for key in keys}

    def write_flat(self, index: int, tensors: dict[str, torch.Tensor], scalars: dict) -> None:
        """Replace one flat group's master shard and (when given) its optimizer state."""
        self.settle()
        for sub in self._subgroups_of[index]:
            self._write_sub(sub, {key: value[sub.start : sub.stop] for key, value in tensors.items()}, scalars)

    def _read_sub(self, sub: SubGroup) -> dict[str, torch.Tensor]:
        return {MASTER: sub.param.detach(), **self.optimizer.state.get(sub.param, {})}

    def _write_sub(self, sub: SubGroup, part: dict[str, torch.Tensor], scalars: dict) -> None:
        master = part.pop(MASTER)
        if master.data_ptr() != sub.param.data_ptr():
            sub.param.detach().copy_(master)
        if part:
            self.optimizer.state[sub.param] = {**part, **{k: _copy(v) for k, v in scalars.items()}}

    def swap_files(self) -> list:
        """The swap files this home reads and writes (their ``stats`` count the bytes)."""
        return []

    # -- memory -----------------------------------------------------------------------------------
    def bytes_held(self) -> dict[str, dict[str, int]]:
        """Bytes of master weights and optimizer state per location. Without waiting for a step running behind
        (the engine samples this after every step): the dicts are copied first (one C call each, which the step's
        thread cannot interleave), and the sizes do not change once the first step has made the state."""
        state = sum(
            value.numel() * value.element_size()
            for per_param in list(self.optimizer.state.values())
            for value in list(per_param.values())
            if torch.is_tensor(value) and value.dim() > 0
        )
        return {"master": {self.location: self._master_bytes()}, "optimizer_state": {self.location: state}}

    def _master_bytes(self) -> int:
        return sum(sub.numel * 4 for sub in self.subgroups)

    def master_bytes_shared_with_params(self) -> int:
        """Bytes counted both as ``master`` and as ``params`` because they are one tensor (fp32 compute)."""
        return 0


class DeviceState(OptimizerState):
    def _subgroups(self, index: int, flat: FlatGroup) -> list[SubGroup]:
        if flat.home is None and flat.dtype == self.master_dtype:
            master = flat.shard  # fp32 compute: the shard is the master (updated in place by the step)
        else:
            master = torch.empty(flat.layout.shard_numel, dtype=self.master_dtype, device=flat.device)
            master.copy_(flat.shard_values())
        return [SubGroup(index, 0, master.numel(), master)]

    def _aliased(self, sub: SubGroup) -> bool:
        shard = self.flats[sub.flat_index].shard
        return shard is not None and shard.data_ptr() == sub.param.data_ptr()

    def step(self, grads: list[torch.Tensor], coef: float = 1.0) -> None:
        """One fused optimizer call over every master shard when the gradients are in the master dtype; one per
        flat group when they need a conversion, bounding the transient copies (and the optimizer's own
        temporaries) to one flat group. Adam-style updates are elementwise and per-parameter, Lamb's norms are
        per parameter (a parameter lies in one flat group): the result is the same either way."""
        same_dtype = all(grad.dtype == self.master_dtype for grad in grads)
        for batch in [self.subgroups] if same_dtype else [[sub] for sub in self.subgroups]:
            for sub in batch:
                sub.param.grad = self._master_grad(grads[sub.flat_index].read(), coef)
            self.optimizer.step()
            for sub in batch:
                sub.param.grad = None
        self.publish()

    def _master_bytes(self) -> int:
        # a stage-3 shard that is its own master is counted once, as parameters
        return sum(
            0 if self._aliased(sub) and not self.flats[sub.flat_index].resident else sub.numel * 4
            for sub in self.subgroups
        )

    def master_bytes_shared_with_params(self) -> int:
        return sum(
            sub.numel * 4 for sub in self.subgroups if self._aliased(sub) and self.flats[sub.flat_index].resident
        )


class HostState(OptimizerState):
    location = "host"

    def __init__(self, *args, sub_group_size: int, pin_memory: bool, **kwargs):
        self.sub_group_size = sub_group_size
        self.pin_memory = pin_memory
        super().__init__(*args, **kwargs)
        if getattr(self.optimizer, "needs_whole_parameter_norms", False):
            raise ValueError(
                "optimizer Lamb needs whole-parameter norms across sub-groups and cannot run with "
                "zero_optimization.offload_optimizer; use Adam/AdamW, Adagrad, Lion or SGD, or remove the offload"
            )

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

    def _sharded_norms(self) -> Optional[ShardedNorms]:
        """The layout while each flat group's shard is one sub-group (sub_group_size is 1e9 by default)."""
        whole = all(len(subs) == 1 for subs in self._subgroups_of)
        return super()._sharded_norms() if whole else None

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
            self._write_back(sub, sub.param.detach())

    @property
    def can_step_behind(self) -> bool:
        # the CPU's step hides behind the device's forward; where the CPU is the compute device they would take
        # turns on the same cores (measured: 2.86 -> 3.25 s per step, 210M GPT, 2 ranks on 2 cores)
        return bool(self.flats) and self.flats[0].device.type != "cpu" and self._no_shard_on_nvme()

    def _no_shard_on_nvme(self) -> bool:
        # a shard on NVMe is read by the forward through the parameter swap file's pool, which this thread owns
        return not any(isinstance(flat.home, NvmeShard) for flat in self.flats)

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
        exact = getattr(self.optimizer, "gradient_exchange", "exact") == "exact"
        if not exact or not isinstance(self.flats[index].home, NvmeShard):
            return super().grad_home(index, dtype, pin, buffers)
        return SpilledGrad(self._subgroups_of[index], self.swapper, buffers, dtype)

    @property
    def can_step_behind(self) -> bool:
        # the step waits on the disk, which the forward does not use: it hides behind it on any device
        return self._no_shard_on_nvme()

    def _ordered(self, grads: list[GradHome], subs: list[SubGroup], optimizer: torch.optim.Optimizer):
        on_disk = frozenset(id(sub.param) for sub in subs if isinstance(grads[sub.flat_index], SpilledGrad))
        return self.swapper.steps(optimizer, subs, with_grad=on_disk)

    def _grad_of(self, sub: SubGroup, home: GradHome) -> torch.Tensor:
        if not isinstance(home, SpilledGrad):
            return super()._grad_of(sub, home)
        staged = self.swapper.staged_grad(sub)
        return staged.zero_() if home.empty else staged  # read with the sub-group; zero when nothing was written

    def _sharded_norms(self) -> Optional[ShardedNorms]:
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
            self.optimizer.state[sub.param] = {k: _copy(v) for k, v in scalars.items()}

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
            sub.numel * 4 * len(list(keys.get(id(sub.param), []))) for sub in self.subgroups
        )
        held["optimizer_state"]["host"] += self.swapper.bytes_in_memory()  # the staging buffers
        return held


def build_optimizer_state(
    flats: list[FlatGroup],
    group_of_flat: list[int],
    param_groups: list[dict],
    make_optimizer: MakeOptimizer,
    master_dtype: torch.dtype,
    offload: OffloadPlan,
    synchronize: Callable[[], None],
    tensor: Optional[comm.Group] = None,
) -> OptimizerState:
    """The optimizer state in the home ``offload_optimizer`` names (``tensor``: the tensor-parallel group, over which
    whole-parameter optimizers complete the norms of split parameters)."""
    args = (flats, group_of_flat, param_groups, make_optimizer)
    if offload.optimizer_device == "nvme":
        return NvmeState(*args, master_dtype=master_dtype, offload=offload, synchronize=synchronize, tensor=tensor)
    if offload.optimizer_device == "cpu":
        return HostState(
            *args,
            master_dtype=master_dtype,
            sub_group_size=offload.sub_group_size,
            pin_memory=offload.pin_memory,
            tensor=tensor,
        )
    return DeviceState(*args, master_dtype=master_dtype, tensor=tensor)


def _copy(value):
    return value.clone() if torch.is_tensor(value) else value
