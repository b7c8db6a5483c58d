"""A flat group: a bucket of trainable parameters in one contiguous buffer, sharded over a group of ranks.

Who owns what, for one flat group on one rank:

- ``buffer`` (compute dtype, whole bucket): the model's parameters are views into it, so an
  all-gather into ``buffer`` updates the model in place.
- ``master`` (fp32, this rank's shard): what the optimizer steps. When the compute dtype is fp32
  it *is* this rank's slice of ``buffer`` (no second copy).
- ``grad`` (fp32, this rank's shard): reduced gradients, accumulated across micro-batches.
- ``staging`` (reduce dtype, whole bucket, transient): gradients on their way to the reduction;
  allocated when the first gradient arrives, freed once the reduction completes.

Stage 0 is a flat group with one shard (all ranks own everything; gradients are all-reduced);
stages 1 and 2 have one shard per rank of the shard group (gradients are reduce-scattered).

Offload moves the optimizer side (``master``, ``grad``; the optimizer state follows ``master``)
to ``state_device`` (host memory), and with ``offload_param`` a stage-3 group's ``shard`` to a
``home`` (host memory or NVMe, see ``zeroshard.offload.param_store``) from which it is fetched
just before each gather.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Callable, Optional

import torch

from .. import comm
from ..partition import FlatLayout
from ..precision import PrecisionPolicy
from . import sharded_param


class GradState(Enum):
    EMPTY = "empty"  # no gradient staged since the last reduction
    STAGING = "staging"  # some gradients copied into the staging buffer
    REDUCING = "reducing"  # collective issued, result not yet accumulated


class ParamState(Enum):
    GATHERED = "gathered"  # the whole buffer exists and the parameters are views into it
    GATHERING = "gathering"  # all-gather issued, parameters not bound yet
    SHARDED = "sharded"  # only this rank's shard exists (stage 3); parameters hold no data


class FlatGroup:
    """See the module docstring. ``resident`` groups (stages 0-2, persistent stage-3 parameters) keep the
    whole buffer; the others (stage 3) gather it before use and free it after."""

    def __init__(
        self,
        layout: FlatLayout,
        params: list[torch.nn.Parameter],
        policy: PrecisionPolicy,
        shard_group: comm.Group,
        replica_group: comm.Group,
        device: torch.device,
        resident: bool = True,
        offload_optimizer: bool = False,
        state_device: Optional[torch.device] = None,
        pin_memory: bool = False,
        shard_home: Optional[Callable[[torch.Tensor], Any]] = None,
    ):
        if layout.shard_count not in (1, shard_group.size):
            raise AssertionError(f"layout has {layout.shard_count} shards, shard group has {shard_group.size} ranks")
        self.layout = layout
        self.params = params
        self.policy = policy
        self.resident = resident
        self.partitioned = layout.shard_count > 1
        self.shard_group = shard_group
        self.replica_group = replica_group
        self.shard_rank = shard_group.rank if self.partitioned else 0
        self.device = device
        full = torch.zeros(layout.padded_numel, dtype=policy.compute, device=device)
        with torch.no_grad():
            for slot, param in zip(layout.slots, params):
                full[slot.offset : slot.end].copy_(param.detach().reshape(-1))
        lo, hi = layout.shard_range(self.shard_rank)
        self.buffer: Optional[torch.Tensor] = None  # the gathered parameters (None while sharded)
        self._storage: Optional[torch.Tensor] = None  # stage 3: the buffer, kept (at zero bytes) while sharded
        self._gather: Optional[comm.Pending] = None
        self.home = None
        if resident:
            self.shard = full[lo:hi]
            self._bind(full)
        else:
            self.shard = full[lo:hi].clone()
            for param in params:
                sharded_param.adopt(param)
            self.free()
        del full
        self.offload_optimizer = offload_optimizer
        self.state_device = state_device or device
        self.master_is_shard = policy.compute == policy.master and not offload_optimizer
        self.master: Optional[torch.Tensor] = self.shard  # the optimizer's fp32 shard; None when it is on NVMe
        if not self.master_is_shard:
            self.master = torch.empty(hi - lo, dtype=policy.master, device=self.state_device, pin_memory=pin_memory)
            self.master.copy_(self.shard)
        self.grad = torch.zeros(hi - lo, dtype=policy.grad, device=self.state_device, pin_memory=pin_memory)
        if shard_home is not None and not resident:
            self.home = shard_home(self.shard)
            self.shard = None
        self.state = GradState.EMPTY
        self._staging: Optional[torch.Tensor] = None
        # Gradient contributions per parameter in this backward, and how many the last backward brought. A
        # parameter recomputed by reentrant activation checkpointing gets one per recomputation (each nested
        # backward fires its hook), so one arrival does not always mean its gradient is final.
        self.arrived = [0] * len(params)
        self.expected: list[Optional[int]] = [None] * len(params)  # None: not yet seen in a backward
        self._reduced: Optional[torch.Tensor] = None
        self._pending: Optional[comm.Pending] = None

    # -- parameter lifecycle (stage 3) ---------------------------------------------------------
    @property
    def param_state(self) -> ParamState:
        if self._gather is not None:
            return ParamState.GATHERING
        return ParamState.GATHERED if self.buffer is not None else ParamState.SHARDED

    def _bind(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer
        for slot, param in zip(self.layout.slots, self.params):
            sharded_param.bind(param, buffer[slot.offset : slot.end].view(slot.shape))

    def gather(self, async_op: bool = False) -> None:
        """Start (or finish, when synchronous) the all-gather of the whole buffer."""
        if self.param_state is not ParamState.SHARDED:
            if not async_op:
                self.wait_gathered()
            return
        if self._storage is None:
            self._storage = torch.empty(self.layout.padded_numel, dtype=self.policy.compute, device=self.device)
        else:
            self._storage.untyped_storage().resize_(self.layout.padded_numel * self._storage.element_size())
        self.buffer = self._storage
        shard = self.shard
        if self.home is not None:
            shard = torch.empty(self.layout.shard_numel, dtype=self.policy.compute, device=self.device)
            shard.copy_(self.home.get())  # blocking: the home's staging buffer is reused after release
            self.home.release()
        self._gather = comm.all_gather(self.buffer, shard, self.shard_group, async_op=True)
        if not async_op:
            self.wait_gathered()

    def fetch(self) -> None:
        """Start bringing an offloaded shard towards the device ahead of its gather (NVMe read-ahead)."""
        if self.home is not None and self.param_state is ParamState.SHARDED:
            self.home.fetch()

    def wait_gathered(self) -> None:
        if self._gather is not None:
            self._gather.wait()
            self._gather = None
            self._bind(self.buffer)

    def free(self) -> None:
        """Drop the whole buffer; the parameters keep their identity but no data until the next gather.

        The memory is released by shrinking the buffer's storage to zero bytes rather than by dropping the
        tensor: autograd keeps views of the gathered weights for backward (e.g. the transposed weight of a
        linear layer), which would otherwise pin every unit's gathered buffer from forward to backward.
        The next gather regrows the same storage, so those views see the re-gathered values."""
        if self.resident:
            raise AssertionError("a resident flat group is never freed")
        self.wait_gathered()
        for slot, param in zip(self.layout.slots, self.params):
            sharded_param.release(param, slot.name, torch.Size(slot.shape))
        if self.buffer is not None:
            self.buffer.untyped_storage().resize_(0)
        self.buffer = None

    @property
    def complete(self) -> bool:
        """Every parameter brought as many gradient contributions as in the last backward (one, before the first):
        the reduction can start."""
        return all(n >= (e or 1) for n, e in zip(self.arrived, self.expected))

    def stage_grad(self, position: int, grad: torch.Tensor) -> None:
        """Stage one gradient contribution; a second one for the same parameter (a reentrant recomputation) adds."""
        slot = self.layout.slots[position]
        if self._staging is None:
            self._staging = torch.empty(self.layout.padded_numel, dtype=self.policy.reduce, device=self.device)
            self.state = GradState.STAGING
        target = self._staging[slot.offset : slot.end]
        if self.arrived[position]:
            target.add_(grad.reshape(-1))
        else:
            target.copy_(grad.reshape(-1))
        self.arrived[position] += 1

    def launch_reduce(self, predivide: float, async_op: bool) -> None:
        """Issue the reduction; parameters whose gradient never arrived (unused this step) count as zero."""
        if self._staging is None:
            self._staging = torch.zeros(self.layout.padded_numel, dtype=self.policy.reduce, device=self.device)
        else:
            for slot, arrived in zip(self.layout.slots, self.arrived):
                if not arrived:
                    self._staging[slot.offset : slot.end].zero_()
            self._staging[self.layout.numel :].zero_()
        if predivide != 1.0:
            self._staging.div_(predivide)
        if self.partitioned:
            self._reduced = torch.empty(self.layout.shard_numel, dtype=self.policy.reduce, device=self.device)
            self._pending = comm.reduce_scatter(self._reduced, self._staging, self.shard_group, async_op=async_op)
        else:
            self._reduced = self._staging
            self._pending = comm.all_reduce(self._staging, self.shard_group, async_op=async_op)
        self.state = GradState.REDUCING

    def finish_reduce(self, post_scale: float) -> None:
        """Wait for the reduction and accumulate this rank's part into the fp32 gradient shard."""
        if self.state is not GradState.REDUCING:
            raise AssertionError(f"finish_reduce in state {self.state}")
        self._pending.wait()
        # hybrid sharding: the shard group reduced one replica's gradients; add the other replicas'
        comm.all_reduce(self._reduced, self.replica_group)
        self.grad.add_(self._reduced.to(self.grad.device), alpha=post_scale)
        self._staging = self._reduced = self._pending = None
        self.expected = [n or e for n, e in zip(self.arrived, self.expected)]  # learned for the next backward
        self.arrived = [0] * len(self.params)
        self.state = GradState.EMPTY

    def write_shard(self, start: int, values: torch.Tensor) -> None:
        """Write updated master values (a range of the shard) into the compute-precision shard."""
        if self.home is not None:
            self.home.write(start, values)
        elif not self.master_is_shard:
            self.shard[start : start + values.numel()].copy_(values, non_blocking=True)

    def finish_publish(self) -> None:
        """After ``write_shard`` covered the shard: a resident group gathers the other ranks' updates."""
        if self.home is not None:
            self.home.flush()
        if self.resident and self.partitioned:
            # in-place all-gather: the input is this rank's own chunk of the output
            comm.all_gather(self.buffer, self.shard, self.shard_group)

    def overwrite(self, values: torch.Tensor) -> None:
        """Replace this rank's shard (compute and master copies) with new values, e.g. from GatheredParameters."""
        if self.home is not None:
            self.home.write(0, values)
            self.home.flush()
        elif self.shard is not None and values.data_ptr() != self.shard.data_ptr():
            self.shard.copy_(values)
        self.write_master(values)

    def write_master(self, values: torch.Tensor) -> None:
        """Replaced by the optimizer when the master weights live on NVMe."""
        if not self.master_is_shard:
            self.master.copy_(values)

    def bytes_held(self) -> dict[str, dict[str, int]]:
        """Bytes per role and where they live: ``device`` (the accelerator, or the compute side on a
        CPU-only machine), ``host`` (offloaded to CPU memory) or ``nvme``."""

        def nbytes(t: Optional[torch.Tensor]) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        state_side = "host" if self.offload_optimizer else "device"
        params = {"device": nbytes(self.buffer) if self.resident else nbytes(self.shard)}
        if self.home is not None:
            params = self.home.bytes()
        return {
            "params": params,
            "gathered": {"device": 0 if self.resident else nbytes(self.buffer)},
            "master": {state_side: 0 if self.master_is_shard and not self.resident else nbytes(self.master)},
            "grad_shard": {state_side: nbytes(self.grad)},
            "staging": {
                "device": nbytes(self._staging) + (nbytes(self._reduced) if self._reduced is not self._staging else 0)
            },
        }
