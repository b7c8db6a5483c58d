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

from typing import Callable, Optional

import torch

from .. import comm
from ..offload import MASTER, SubGroup, elementwise_keys
from ..optim import ShardedNorms
from .buffers import ReusableBuffers
from .flat_group import FlatGroup
from .grad_home import GradHome, ResidentGrad
from .step_behind import StepBehind

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
    def stepping_behind(self) -> bool:
        """Whether a step launched behind the forward has not been waited for yet."""
        return self.behind is not None and self.behind.running

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
            self.optimizer.state[sub.param] = {**part, **copied(scalars)}

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


def copied(scalars: dict) -> dict:
    """The optimizer's scalar state with its tensors copied (a checkpoint's values are not aliased)."""
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in scalars.items()}
