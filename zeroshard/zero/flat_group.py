"""A flat group: a bucket of trainable parameters in one contiguous buffer, sharded over a group of ranks.

This object owns the compute side of one flat group on one rank:

- ``buffer`` (compute dtype, whole bucket): the model's parameters are views into it, so an
  all-gather into ``buffer`` updates the model in place. Resident groups own theirs; stage-3 groups draw it
  from the engine's :class:`~zeroshard.zero.buffers.ReusableBuffers` at each gather and give it back when freed.
- ``shard`` (compute dtype, this rank's slice): for resident groups a view of ``buffer``; for stage-3
  groups the only copy kept between gathers, unless ``offload_param`` moved it to a ``home`` (host
  memory or NVMe, see ``zeroshard.offload.param_store``) from which it is fetched before each gather.

Stage 0 is a flat group with one shard (all ranks own everything); stages 1-3 have one shard per rank
of the shard group. Gradients are the reducer's (:mod:`zeroshard.zero.reducer`), master weights and
optimizer state the optimizer state's (:mod:`zeroshard.zero.optimizer_state`).
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from enum import Enum
from typing import Callable, Optional

import torch

from .. import comm
from ..accelerator import copy_across, crossed, moved_across
from ..comm.compression import Codec
from ..offload import ShardHome
from ..partition import FlatLayout
from .buffers import ReusableBuffers
from .sharded_param import ParamRecords


class ParamState(Enum):
    GATHERED = "gathered"  # the whole buffer exists and the parameters are views into it
    GATHERING = "gathering"  # all-gather issued, parameters not bound yet
    SHARDED = "sharded"  # only this rank's shard exists (stage 3); parameters hold no data


class FlatGroup:
    """See the module docstring. ``resident`` groups (stages 0-2, persistent stage-3 parameters) keep the
    whole buffer; the others (stage 3) gather it before use and free it after."""

    def __init__(
        self,
        *,
        layout: FlatLayout,
        params: list[torch.nn.Parameter],
        compute_dtype: torch.dtype,
        shard_group: comm.Group,
        device: torch.device,
        records: ParamRecords,
        buffers: ReusableBuffers,
        resident: bool = True,
        shard_home: Optional[Callable[[torch.Tensor], ShardHome]] = None,
        gather_codec: Optional[Codec] = None,
    ):
        if layout.shard_count not in (1, shard_group.size):
            raise AssertionError(f"layout has {layout.shard_count} shards, shard group has {shard_group.size} ranks")
        self.layout = layout
        self.params = params
        self.dtype = compute_dtype
        self.resident = resident
        self.partitioned = layout.shard_count > 1
        self.shard_group = shard_group
        self.shard_rank = shard_group.rank if self.partitioned else 0
        self.device = device
        self.records = records
        self.buffers = buffers
        self.gather_codec = gather_codec  # ZeRO++: the all-gathers of forward and backward send quantized shards
        full = torch.zeros(layout.padded_numel, dtype=compute_dtype, device=device)
        with torch.no_grad():
            for slot, param in zip(layout.slots, params):
                full[slot.offset : slot.end].copy_(param.detach().reshape(-1))
        lo, hi = layout.shard_range(self.shard_rank)
        self.buffer: Optional[torch.Tensor] = None  # the gathered parameters (None while sharded)
        self._gather: Optional[comm.Pending] = None
        self.home: Optional[ShardHome] = None
        self._update: Optional[Future] = None  # an optimizer step running behind is writing the shard (step_behind)
        self.shard: Optional[torch.Tensor]
        if resident:
            self.shard = full[lo:hi]
            self._bind(full)
        else:
            self.shard = full[lo:hi].clone()
            for param in params:
                records.adopt(param)
            self.free()
        del full
        if shard_home is not None and not resident:
            self.home = shard_home(self.shard)
            self.shard = None
        records.place(self)

    # -- parameter lifecycle (stage 3) ---------------------------------------------------------
    @property
    def param_state(self) -> ParamState:
        if self._gather is not None:
            return ParamState.GATHERING
        return ParamState.GATHERED if self.buffer is not None else ParamState.SHARDED

    def _bind(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer
        for slot, param in zip(self.layout.slots, self.params):
            self.records.bind(param, buffer[slot.offset : slot.end].view(slot.shape))

    def gather(self, async_op: bool = False, exact: bool = False) -> None:
        """Start (or finish, when synchronous) the all-gather of the whole buffer; with a ``gather_codec`` every
        rank's shard arrives quantized (every rank, its owner included, computes with the same values) unless
        ``exact`` (``GatheredParameters``: the values themselves)."""
        if self.param_state is not ParamState.SHARDED:
            if not async_op:
                self.wait_gathered()
            return
        self.await_update()
        self.buffer = self.buffers.acquire(self.layout.padded_numel, self.dtype, owner=self)
        shard = self.shard
        if self.home is not None:
            shard = torch.empty(self.layout.shard_numel, dtype=self.dtype, device=self.device)
            if self.home.on_host:  # blocking: the home's staging buffer is reused after release
                copy_across(shard, self.home.get(), to_host=False)
            else:
                shard.copy_(self.home.get())
            self.home.release()
        if self.gather_codec is not None and not exact:
            self._gather = comm.compressed_all_gather(
                self.buffer, None, self.shard_group, async_op=True, codec=self.gather_codec, input=shard
            )
        else:
            self._gather = comm.all_gather(self.buffer, shard, self.shard_group, async_op=True)
        if not async_op:
            self.wait_gathered()

    def fetch(self) -> None:
        """Start bringing an offloaded shard towards the device ahead of its gather (NVMe read-ahead); not while a
        step running behind has yet to write it (the read would see the old values)."""
        if self.home is not None and self.param_state is ParamState.SHARDED and not self.update_pending:
            self.home.fetch()

    def wait_gathered(self) -> None:
        if self._gather is not None:
            self._gather.wait()
            self._gather = None
            self._bind(self.buffer)

    def free(self) -> None:
        """Give the whole buffer back; the parameters keep their identity but no data until the next gather.

        The next gather may draw another buffer: views of this one that autograd saved for backward (e.g. the
        transposed weight of a linear layer) are saved as positions in this flat group instead, and rebuilt
        from the re-gathered buffer when backward needs them (``Stage3Runtime``'s saved-tensor hooks)."""
        if self.resident:
            raise AssertionError("a resident flat group is never freed")
        self.wait_gathered()
        for slot, param in zip(self.layout.slots, self.params):
            self.records.release(param, slot.name, torch.Size(slot.shape))
        if self.buffer is not None:
            self.buffers.release(self.buffer)
        self.buffer = None

    # -- this rank's shard ---------------------------------------------------------------------
    def shard_values(self) -> torch.Tensor:
        """This rank's shard in the compute dtype (a copy when it lives in an offload home)."""
        self.await_update()
        if self.home is None:
            return self.shard
        stored = self.home.get()
        values = moved_across(stored, self.device, False, copy=True) if self.home.on_host else stored.clone()
        self.home.release()
        return values

    def write_shard(self, start: int, values: torch.Tensor, from_host: bool = False) -> None:
        """Write updated values (a range of this rank's shard) into the compute-precision shard. ``from_host``: the
        values are in host memory (an offloaded optimizer's), so the copy crosses the host link unless the shard's
        home is there too."""
        if self.home is not None:
            started = time.perf_counter()
            self.home.write(start, values)
            if self.home.on_host != from_host:
                crossed(values.numel() * values.element_size(), self.home.on_host, started)
        elif from_host:
            copy_across(self.shard[start : start + values.numel()], values, to_host=False, non_blocking=True)
        elif values.data_ptr() != self.shard[start:].data_ptr():
            self.shard[start : start + values.numel()].copy_(values, non_blocking=True)

    def whole_of(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` laid out as this rank's shard (optimizer state, an update), gathered from every rank of the
        shard group into the whole padded flat group: ``values`` itself when the group is not partitioned."""
        if not self.partitioned:
            return values
        out = values.new_empty(self.layout.padded_numel)
        comm.all_gather(out, values.contiguous(), self.shard_group)
        return out

    def finish_publish(self) -> None:
        """After ``write_shard`` covered the shard: an offloaded shard is written home, a resident group
        gathers the other ranks' updates."""
        if self.home is not None:
            self.home.flush()
        if self.resident and self.partitioned:
            # in-place all-gather: the input is this rank's own chunk of the output
            comm.all_gather(self.buffer, self.shard, self.shard_group)
        self.finish_update()

    # -- an optimizer step running behind the forward (zeroshard.zero.step_behind) ------------------
    def expect_update(self, update: Future) -> None:
        """A step on another thread is about to write this shard: reads of it wait for ``update``."""
        self._update = update

    def finish_update(self, error: Optional[BaseException] = None) -> None:
        """The step's thread is done with this shard (``error``: it failed before publishing it)."""
        update = self._update
        if update is not None and not update.done():
            if error is None:
                update.set_result(None)
            else:
                update.set_exception(error)

    @property
    def update_pending(self) -> bool:
        """Whether a step on another thread has yet to publish this shard (a prefetch then leaves it be)."""
        return self._update is not None and not self._update.done()

    def await_update(self) -> None:
        """Return once no step is writing this shard (raise the step's error if it failed)."""
        update = self._update
        if update is not None:
            update.result()
            self._update = None  # only once it is done: until then the step's thread resolves it through this field

    def bytes_held(self) -> dict[str, dict[str, int]]:
        """Bytes per role and where they live: ``device`` (the accelerator, or the compute side on a
        CPU-only machine), ``host`` (offloaded to CPU memory) or ``nvme``."""
        params = {"device": _nbytes(self.buffer) if self.resident else _nbytes(self.shard)}
        if self.home is not None:
            params = self.home.bytes()
        return {"params": params, "gathered": {"device": 0 if self.resident else _nbytes(self.buffer)}}


def _nbytes(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.numel() * t.element_size()
