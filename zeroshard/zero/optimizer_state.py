"""The optimizer's side of ZeRO: fp32 master weights and optimizer state for this rank's shards, one
implementation per home. This module holds what every home shares (:class:`OptimizerState`) and
:class:`DeviceState`: on the compute device; the optimizer steps every flat group's master shard in one call (one
call per flat group when 16-bit gradients need fp32 copies). With fp32 compute the master *is* the flat group's
shard (no second copy). The offloaded homes, host and NVMe, and the choice among all three are in
:mod:`.offloaded_state`; they can run their step behind the next forward (:mod:`.step_behind`), and every other
read or write of the state waits for such a step first (``settle``).

Each owns its sub-groups, the torch optimizer over them, the step, publishing the updated values into the
flat groups, checkpoint reads and writes of one flat group's state, and the byte counts of what it holds.
Gradients come in from the reducer (:mod:`zeroshard.zero.reducer`).
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from typing import Callable, Mapping, Optional

import torch

from .. import comm
from ..offload import MASTER, SubGroup, elementwise_keys
from ..optim.contract import ShardLayout, needs_of, refusal
from .buffers import ReusableBuffers
from .flat_group import FlatGroup
from .grad_home import GradHome, ResidentGrad
from .shard_layout import FlatShardLayout
from .speculation import Speculation
from .step_behind import StepBehind, second_handle

MakeOptimizer = Callable[[list[dict], Optional[ShardLayout]], torch.optim.Optimizer]


class OptimizerState:
    """What every home shares; subclasses place the master weights (``_subgroups``) and step them (``step``).

    ``group_of_flat[k]`` is the optimizer parameter group of flat group ``k``; ``param_groups`` the groups'
    hyperparameters; ``make_optimizer(master_groups, layout)`` builds the torch optimizer over the master
    tensors (``layout``: where each parameter lies in them, :mod:`.shard_layout`; ``pieces``: the group along each
    split axis, ``Mesh.pieces``). An optimizer whose declared needs no layout here can meet is refused by name
    (:func:`zeroshard.optim.contract.refusal`)."""

    location = "device"  # where the master weights, gradient shards and optimizer state live

    def __init__(
        self,
        flats: list[FlatGroup],
        group_of_flat: list[int],
        param_groups: list[dict],
        make_optimizer: MakeOptimizer,
        master_dtype: torch.dtype,
        pieces: Optional[Mapping[str, comm.Group]] = None,
    ):
        self.flats = flats
        for flat in flats:
            flat.records.keep(flat, self)
        self.pieces = pieces or {}
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
        layout = self._layout()
        self.optimizer = make_optimizer(master_groups, layout)
        reason = refusal(
            type(self.optimizer).__name__,
            needs_of(self.optimizer),
            partitioned=any(flat.partitioned for flat in flats),
            axes=self._split_axes(),
            whole_shards=layout is not None,
        )
        if reason is not None:
            raise NotImplementedError(reason)
        self.behind: Optional[StepBehind] = None  # the worker running a step behind the forward, once one ran
        self.speculation: Optional[Speculation] = None  # the step during backward (offloaded homes that enable it)
        self._grad_homes: dict[int, GradHome] = {}  # flat index -> where its reduced gradient waits (grad_home)

    def settle(self) -> None:
        """Wait for a step running behind the forward, and for steps speculated during backward, if any are
        (raising the error of one that failed)."""
        if self.behind is not None:
            self.behind.wait()
        if self.speculation is not None:
            try:
                self.speculation.wait()
            except BaseException:
                self.abandon_speculation()  # the flat groups stepped before the failure
                raise

    @property
    def stepping_behind(self) -> bool:
        """Whether a step launched behind the forward has not been waited for yet."""
        return self.behind is not None and self.behind.running

    @property
    def can_step_behind(self) -> bool:
        """Whether :meth:`step_behind` may run (the host and NVMe states, unless a shard lives on NVMe)."""
        return False

    def close(self) -> None:
        """Finish a step running behind and stop its worker thread."""
        try:
            if self.behind is not None:
                self.behind.close()
        finally:
            if self.speculation is not None:
                self.speculation.close()

    # -- the step during backward (:mod:`.speculation`) --------------------------------------------
    def arm_speculation(self, scale: float) -> None:
        """Before the backward that ends an accumulation (``scale``: the loss scale it runs under)."""
        if self.speculation is not None:
            self.speculation.arm(scale, self.optimizer)

    def gradient_final(self, index: int) -> None:
        """Flat group ``index``'s reduced gradient is final for this step (the reducer's call)."""
        if self.speculation is not None:
            self.speculation.offer(index)

    def resolve_speculation(self, clean: bool, scale: float) -> list[int]:
        """The step's verdict on what was speculated (``clean``: on the gradients alone): the flat groups to
        :meth:`commit`, in order; a speculation that does not commit is discarded here."""
        if self.speculation is None:
            return []
        done, commit = self.speculation.resolve(clean, scale, self.optimizer, self._step_bytes)
        if commit:
            return sorted(done)
        for index in done:
            self.discard(index)
        return []

    def abandon_speculation(self) -> None:
        """A gradient, master weight or optimizer state is about to be written: steps speculated from the old
        values are discarded (the step runs after the verdict, as without speculation)."""
        if self.speculation is not None:
            for index in self.speculation.abandon():
                self.discard(index)

    def state_keys_per_element(self) -> int:
        """How many elementwise state tensors the optimizer makes (Adam 2, Lion 1, ...), before its first step."""
        return probe_state_keys(self.optimizer, self.master_dtype)

    def _step_bytes(self, index: int) -> int:
        """Bytes of master weights and state one step of flat group ``index`` reads and writes."""
        numel = self.flats[index].layout.shard_numel
        return 2 * numel * 4 * (1 + len(self.state_keys(index)))

    def speculate(self, index: int, coef: float, optimizer: torch.optim.Optimizer) -> Optional[int]:
        """Step flat group ``index`` into shadow slots (on the speculation's worker); the sub-groups stepped, or
        None when there is no room for its shadows. Homes that speculate override it, with :meth:`commit` and
        :meth:`discard`."""
        raise NotImplementedError

    def commit(self, index: int) -> None:
        raise NotImplementedError

    def discard(self, index: int) -> None:
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        return self.flats[0].device if self.flats else torch.device("cpu")

    def _subgroups(self, index: int, flat: FlatGroup) -> list[SubGroup]:
        raise NotImplementedError

    def _layout(self) -> Optional[ShardLayout]:
        """Where each parameter lies in the master shards (:mod:`.shard_layout`). Valid while every sub-group is a
        whole shard; homes that cut shards answer None."""
        return FlatShardLayout(self.flats, self.subgroups, self.pieces)

    def _split_axes(self) -> dict[str, int]:
        """The split axes of the flat groups here (tensor or expert parallelism) with more than one piece."""
        axes = {flat.layout.split_axis for flat in self.flats} - {None}
        sizes = {axis: self.pieces[axis].size for axis in sorted(axes) if axis in self.pieces}
        return {axis: size for axis, size in sizes.items() if size > 1}

    def grad_home(self, index: int, dtype: torch.dtype, pin: bool, buffers: ReusableBuffers) -> GradHome:
        """Where flat group ``index``'s reduced gradient shard waits for the step: beside this state's master weights
        (``dtype``: the policy's gradient dtype; ``buffers``: the engine's reusable ones, for transient work)."""
        numel = self.flats[index].layout.shard_numel
        home = self._grad_homes[index] = ResidentGrad.zeros(numel, dtype, self.device, pin, self.location)
        return home

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
        flat.write_shard(sub.start, values, from_host=self._location_of(sub) != "device")
        if sub.stop == flat.layout.shard_numel:
            flat.finish_publish()

    def overwrite(self, flat: FlatGroup, values: torch.Tensor) -> None:
        """Replace one flat group's shard, compute and master copies, with new values (``GatheredParameters``
        with a modifier rank)."""
        self.settle()
        self.abandon_speculation()
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
        self.abandon_speculation()
        for sub in self._subgroups_of[index]:
            self._write_sub(sub, {key: value[sub.start : sub.stop] for key, value in tensors.items()}, scalars)

    def _read_sub(self, sub: SubGroup) -> dict[str, torch.Tensor]:
        return {MASTER: sub.param.detach(), **self.optimizer.state.get(sub.param, {})}

    def _write_sub(self, sub: SubGroup, part: dict[str, torch.Tensor], scalars: dict) -> None:
        master = part.pop(MASTER)
        if master.data_ptr() != sub.param.data_ptr():
            sub.param.detach().copy_(master)
        if part:
            self.optimizer.state[sub.param] = {**part, **copied(scalars)}

    def swap_files(self) -> list:
        """The swap files this home reads and writes (their ``stats`` count the bytes)."""
        return []

    # -- memory -----------------------------------------------------------------------------------
    def bytes_held(self) -> dict[str, dict[str, int]]:
        """Bytes of master weights and optimizer state per location. Without waiting for a step running behind
        (the engine samples this after every step): each dict is copied first (one C call, which the step's thread
        cannot interleave), and the sizes do not change once the first step has made the state."""
        held: dict[str, dict[str, int]] = {"master": {}, "optimizer_state": {}}
        for sub in self.subgroups:
            where = self._location_of(sub)
            held["master"][where] = held["master"].get(where, 0) + self._master_bytes_of(sub)
            held["optimizer_state"][where] = held["optimizer_state"].get(where, 0) + self._state_bytes_of(sub)
        return held

    def _location_of(self, sub: SubGroup) -> str:
        """Where a sub-group's master weights and state live (``location``; a flat group ``ratio`` keeps on the
        compute device says so)."""
        return self.location

    def _state_bytes_of(self, sub: SubGroup) -> int:
        state = dict(self.optimizer.state.get(sub.param) or {})
        return sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v) and v.dim() > 0)

    def _master_bytes_of(self, sub: SubGroup) -> int:
        # a stage-3 shard that is its own master is counted once, as parameters
        return 0 if self._aliased(sub) and not self.flats[sub.flat_index].resident else sub.numel * 4

    def _aliased(self, sub: SubGroup) -> bool:
        """Whether the sub-group's master is the flat group's compute shard itself (fp32 on the device)."""
        shard = self.flats[sub.flat_index].shard
        return shard is not None and shard.data_ptr() == sub.param.data_ptr() and sub.param.numel() > 0

    def master_bytes_shared_with_params(self) -> int:
        """Bytes counted both as ``master`` and as ``params`` because they are one tensor (fp32 compute)."""
        return sum(
            sub.numel * 4 for sub in self.subgroups if self._aliased(sub) and self.flats[sub.flat_index].resident
        )


def probe_state_keys(optimizer: torch.optim.Optimizer, master_dtype: torch.dtype) -> int:
    """How many elementwise state tensors ``optimizer`` makes per parameter (Adam 2, Lion 1, ...), before its first
    step: one step of a copy of it (its class, its first group's hyperparameters, a state of its own, no hooks) over
    64 elements; the optimizer itself is untouched. 2 (Adam's moments) when the copy cannot step."""
    probe = torch.nn.Parameter(torch.zeros(64, dtype=master_dtype))
    probe.grad = torch.ones_like(probe)
    copy = second_handle(optimizer)
    copy.param_groups = [{**{k: v for k, v in optimizer.param_groups[0].items() if k != "params"}, "params": [probe]}]
    copy.state = defaultdict(dict)
    copy._optimizer_step_pre_hooks, copy._optimizer_step_post_hooks = OrderedDict(), OrderedDict()
    try:
        copy.step()
    except Exception:
        return 2
    return len(elementwise_keys(copy.state.get(probe, {}), probe))


def device_master(flat: FlatGroup, master_dtype: torch.dtype) -> torch.Tensor:
    """A flat group's master shard on the compute device: the shard itself with fp32 compute (updated in place by
    the step), else an fp32 copy."""
    if flat.home is None and flat.dtype == master_dtype:
        return flat.shard
    master = torch.empty(flat.layout.shard_numel, dtype=master_dtype, device=flat.device)
    return master.copy_(flat.shard_values())


class DeviceState(OptimizerState):
    def _subgroups(self, index: int, flat: FlatGroup) -> list[SubGroup]:
        return [SubGroup(index, 0, flat.layout.shard_numel, device_master(flat, self.master_dtype))]

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


def copied(scalars: dict) -> dict:
    """The optimizer's scalar state with its tensors copied (a checkpoint's values are not aliased)."""
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in scalars.items()}
