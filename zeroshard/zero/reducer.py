"""Gradient reduction: the hooks that see gradients arrive, one bucket per flat group, and the reductions.

A :class:`GradBucket` owns the gradient side of one flat group on one rank:

- ``staging`` (reduce dtype, whole bucket, transient): gradients on their way to the reduction; drawn from
  the engine's :class:`~zeroshard.zero.buffers.ReusableBuffers` when a gradient arrives for the bucket next to
  reduce (or, for a bucket that parked gradients, at its launch), given back once the reduction completes.
  The reduce-scatter runs in place: this rank's chunk of it receives the sum. Gradients that arrive before
  their bucket is next are kept as autograd made them (``parked``): a bucket whose first gradients come long
  before its last (stage 3's root unit: the final norm's at the start of backward, the embedding's at the
  end) would otherwise hold a whole staging buffer through backward for a few elements.
- ``home`` (this rank's shard, in the precision policy's gradient dtype: fp32 at stages 0-2, the compute dtype at
  stage 3, unless ``data_types.grad_accum_dtype``): reduced gradients, accumulated across micro-batches, where the
  optimizer state steps them (:mod:`.grad_home`: on the device, in host memory, or in the NVMe swap file). Under
  the ``LOCAL`` reduction it holds this rank's own gradient of the whole bucket instead (see :class:`Reduction`).

A :class:`GradientReducer` owns the buckets, the post-accumulate-grad hooks, and the schedule: which
bucket reduces when, in one rank-independent order, with a bounded number in flight; and the :class:`Reduction`
the next backward uses (a 1-bit optimizer past its warm-up changes it, see Note [1-bit reduction] in
``docs/design.md``).
"""

from __future__ import annotations

from collections import deque
from enum import Enum
from typing import Callable, Optional

import torch

from .. import comm
from ..comm.compression import Codec
from .buffers import ReusableBuffers
from .flat_group import FlatGroup
from .grad_home import GradHome
from .gradient_check import GradientCheck

MAX_IN_FLIGHT = 1  # overlapped reductions pending at once (each holds one bucket's staging and scratch buffers)


class UnusedParameterError(RuntimeError, AssertionError):
    """A trainable parameter got no gradient under ``ignore_unused_parameters: false``. An ``AssertionError`` too,
    because DeepSpeed asserts there and its clients' tests expect that class."""


class Reduction(Enum):
    EXACT = "exact"  # summed across ranks: all-reduce (stage 0) or reduce-scatter
    QUANTIZED = "quantized"  # reduce-scattered as block-quantized chunks, summed in fp32 (ZeRO++ qgZ): not exact
    LOCAL = "local"  # not reduced, kept whole: the step communicates (a 1-bit optimizer after its warm-up)


class GradState(Enum):
    EMPTY = "empty"  # no gradient staged since the last reduction
    STAGING = "staging"  # some gradients copied into the staging buffer
    REDUCING = "reducing"  # collective issued, result not yet accumulated


class GradBucket:
    """See the module docstring. Stage 0 all-reduces the whole bucket; sharded stages reduce-scatter it over the
    flat group's shard group, then (hybrid sharding) all-reduce the shard over the replica group."""

    def __init__(
        self,
        *,
        flat: FlatGroup,
        reduce_dtype: torch.dtype,
        home: GradHome,
        replica_group: Optional[comm.Group],
        buffers: ReusableBuffers,
    ):
        self.flat = flat
        self.group = flat.shard_group  # the group this bucket reduces over (a test seam can point it elsewhere)
        self.buffers = buffers
        self.layout = flat.layout
        self.reduce_dtype = reduce_dtype
        self.replica_group = replica_group
        self.home = home
        self.state = GradState.EMPTY
        self._staging: Optional[torch.Tensor] = None
        self._parked: dict[int, torch.Tensor] = {}  # position -> gradient that arrived before the staging buffer
        self._reduced: Optional[torch.Tensor] = None
        self._scratch: Optional[torch.Tensor] = None  # the collective's scratch buffer (Gloo) while reducing
        self._pending: Optional[comm.Pending] = None
        # Gradient contributions per parameter in this backward, and how many the last backward brought. A
        # parameter recomputed by reentrant activation checkpointing gets one per recomputation (each nested
        # backward fires its hook), so one arrival does not always mean its gradient is final.
        self.arrived = [0] * len(flat.params)
        self.expected: list[Optional[int]] = [None] * len(flat.params)  # None: not yet seen in a backward

    @property
    def complete(self) -> bool:
        """Every parameter brought as many gradient contributions as in the last backward (one, before the first):
        the reduction can start."""
        return all(n >= (e or 1) for n, e in zip(self.arrived, self.expected))

    def stage_grad(self, position: int, grad: torch.Tensor, next_to_reduce: bool) -> None:
        """Stage one gradient contribution; a second one for the same parameter (a reentrant recomputation) adds.
        A bucket not ``next_to_reduce`` parks it instead (see the module docstring), and one that parked keeps
        parking until its launch draws the staging buffer -- after stage 3 freed its gathered parameters, whose
        buffer the staging may then reuse."""
        if self._staging is None and (self._parked or not next_to_reduce):
            parked = self._parked.get(position)
            self._parked[position] = grad if parked is None else parked + grad
        else:
            self._draw_staging()
            self._stage(position, grad, add=self.arrived[position] > 0)
        self.arrived[position] += 1

    def _draw_staging(self) -> None:
        if self._staging is None:
            self._staging = self.buffers.acquire(self.layout.padded_numel, self.reduce_dtype)
            self.state = GradState.STAGING
            for position, grad in self._parked.items():
                self._stage(position, grad, add=False)
            self._parked.clear()

    def _stage(self, position: int, grad: torch.Tensor, add: bool) -> None:
        slot = self.layout.slots[position]
        target = self._staging[slot.offset : slot.end]
        if add:
            target.add_(grad.reshape(-1))
        else:
            target.copy_(grad.reshape(-1))

    def launch_reduce(
        self, predivide: float, async_op: bool, reduction: Reduction = Reduction.EXACT, codec: Optional[Codec] = None
    ) -> None:
        """Issue the reduction (``codec``: the quantized one's); parameters whose gradient never arrived (unused this
        step) count as zero. Unpartitioned (stage 0, or a shard group of one) it is an all-reduce, never quantized."""
        self._draw_staging()
        for slot, arrived in zip(self.layout.slots, self.arrived):
            if not arrived:
                self._staging[slot.offset : slot.end].zero_()
        self._staging[self.layout.numel :].zero_()
        if predivide != 1.0:
            self._staging.div_(predivide)
        if reduction is Reduction.LOCAL:  # this rank's own gradient, kept: nothing to wait for
            self._reduced, self._pending = self._staging, None
        elif not self.flat.partitioned:
            self._reduced, self._pending = self._all_reduce(async_op)
        elif reduction is Reduction.QUANTIZED:
            self._reduced, self._pending = self._quantized_reduce_scatter(async_op, codec)
        else:
            self._reduced, self._pending = self._reduce_scatter(async_op)
        self.state = GradState.REDUCING

    def _all_reduce(self, async_op: bool) -> tuple[torch.Tensor, comm.Pending]:
        """Stage 0: every rank keeps the whole summed bucket."""
        return self._staging, comm.all_reduce(self._staging, self.group, async_op=async_op)

    def _reduce_scatter(self, async_op: bool) -> tuple[torch.Tensor, comm.Pending]:
        """Stages 1-3: in place, this rank's chunk of the input receives the sum (Gloo's scratch from the pool)."""
        lo, hi = self.layout.shard_range(self.flat.shard_rank)
        scratch = comm.reduce_scatter_scratch_numel(self.group, self.layout.padded_numel)
        if scratch:
            self._scratch = self.buffers.acquire(scratch, self.reduce_dtype)
        shard = self._staging[lo:hi]
        return shard, comm.reduce_scatter(shard, self._staging, self.group, async_op=async_op, scratch=self._scratch)

    def _quantized_reduce_scatter(self, async_op: bool, codec: Codec) -> tuple[torch.Tensor, comm.Pending]:
        """ZeRO++ qgZ: block-quantized chunks sent, the owner summing the decompressed ones in fp32."""
        lo, hi = self.layout.shard_range(self.flat.shard_rank)
        pending = comm.compressed_reduce_scatter(self._staging, None, self.group, async_op=async_op, codec=codec)
        return self._staging[lo:hi], pending

    @property
    def grad(self) -> torch.Tensor:
        """The gradient shard as a tensor where it is resident (the tensor itself), else a copy read back."""
        return self.home.read()

    def finish_reduce(self, post_scale: float, final: bool) -> None:
        """Wait for the reduction and accumulate this rank's part into the gradient shard (``final``: the
        step's last contribution)."""
        if self.state is not GradState.REDUCING:
            raise AssertionError(f"finish_reduce in state {self.state}")
        if self._pending is not None:
            self._pending.wait()
        # hybrid sharding: the shard group reduced one replica's gradients; add the other replicas'
        if self.replica_group is not None:
            comm.all_reduce(self._reduced, self.replica_group)
        self.home.accumulate(self._reduced, post_scale, final)
        self.buffers.release(self._staging)
        if self._scratch is not None:
            self.buffers.release(self._scratch)
        self._staging = self._reduced = self._pending = self._scratch = None
        self.expected = [n or e for n, e in zip(self.arrived, self.expected)]  # learned for the next backward
        self.arrived = [0] * len(self.arrived)
        self.state = GradState.EMPTY

    @property
    def holds_whole(self) -> bool:
        """Whether ``grad`` covers the whole padded flat group (stage 0, or this rank's own gradient under ``LOCAL``)
        rather than this rank's shard."""
        return self.home.numel == self.layout.padded_numel

    def hold_whole(self, whole: bool) -> None:
        """Size the home for this rank's shard of the reduced gradient, or (``whole``) its own unreduced gradient of
        the whole bucket; called between steps, when it holds nothing (a resident home: 1-bit optimizers keep
        their gradients in memory)."""
        numel = self.layout.padded_numel if whole else self.layout.shard_numel
        if self.home.numel != numel:
            self.home.resize(numel)

    def staging_bytes(self) -> int:
        return _nbytes(self._staging) + _nbytes(self._scratch) + sum(_nbytes(g) for g in self._parked.values())


class GradientReducer:
    """Reduces the gradients of every flat group once per optimizer step (stages 0-1) or once per micro-batch
    (stages 2-3), as backward produces them; see Note [gradient contributions] for when a bucket is complete.

    ``on_bucket_complete`` (stage 3) is told when a flat group's gradients are all in, so its gathered
    parameters can be freed before the reduction finishes; ``on_gradient_final`` (an offloaded optimizer that steps
    during backward, :mod:`.speculation`) is told a bucket's index once its reduced gradient is final for the step."""

    def __init__(
        self,
        buckets: list[GradBucket],
        param_names: dict[torch.nn.Parameter, str],
        gradient_group: comm.Group,
        *,
        reduce_every_micro_step: bool,
        overlap_comm: bool,
        predivide: float = 1.0,
        ignore_unused_parameters: bool = True,
        on_bucket_complete: Optional[Callable[[FlatGroup], None]] = None,
        on_gradient_final: Optional[Callable[[int], None]] = None,
        check: Optional[GradientCheck] = None,
    ):
        self.buckets = buckets
        self.check = check  # gradient_check: projections before and after reduction (Note [gradient check])
        self.param_names = param_names
        self.gradient_group = gradient_group  # every rank whose gradients sum into one update (all but tensor)
        self.reduce_every_micro_step = reduce_every_micro_step
        self.overlap_comm = overlap_comm
        self.predivide = predivide
        self.ignore_unused_parameters = ignore_unused_parameters
        self.on_bucket_complete = on_bucket_complete
        self.on_gradient_final = on_gradient_final
        self._index = {id(bucket): index for index, bucket in enumerate(buckets)}
        self._owner = {param: (k, pos) for k, b in enumerate(buckets) for pos, param in enumerate(b.flat.params)}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._owner]
        self._reducing = False
        self._boundary = False
        self._next_launch = 0
        self._outer_task: Optional[int] = None  # autograd graph task of the engine's backward call
        self._root_hook = None  # the hook on the loss that notes that task, removed at the end of backward
        self._launch_limit = 0  # buckets from this index wait for the end of backward (see _on_grad)
        self._in_flight: deque[GradBucket] = deque()  # reductions launched, not yet accumulated
        self._reduction = Reduction.EXACT
        self.codec: Optional[Codec] = None  # what the QUANTIZED reduction sends (the exchange that uses it sets it)

    @property
    def reduction(self) -> Reduction:
        """How the next backward's gradients are reduced; set between steps (the buckets' gradients resize)."""
        return self._reduction

    @reduction.setter
    def reduction(self, reduction: Reduction) -> None:
        self._reduction = reduction
        for bucket in self.buckets:
            bucket.hold_whole(reduction is Reduction.LOCAL)

    def set_reduce_dtype(self, dtype: torch.dtype) -> None:
        """Reduce in ``dtype`` from the next backward on (DeepSpeed's ``communication_data_type``, set after
        ``initialize``); only between steps, when no bucket holds a gradient."""
        busy = [self.param_names[b.flat.params[0]] for b in self.buckets if b.state is not GradState.EMPTY]
        if busy:
            raise RuntimeError(
                f"rank {comm.get_rank()}: communication_data_type set while gradients wait in their buckets (from "
                f"'{busy[0]}' on); set it between optimizer steps"
            )
        for bucket in self.buckets:
            bucket.reduce_dtype = dtype

    @property
    def grads(self) -> list[GradHome]:
        """Where the reduced gradient shards wait for the step, one per flat group."""
        return [bucket.home for bucket in self.buckets]

    def begin_backward(self, boundary: bool, root: Optional[torch.Tensor]) -> None:
        """Called before ``root.backward()``; ``root`` tells which autograd graph task is the outer backward (None:
        there are several, each gradient's arrival counted as from a nested one)."""
        self._reducing = boundary or self.reduce_every_micro_step
        self._boundary = boundary
        if self._reducing and self.check is not None:
            self.check.note_reduction()
        self._next_launch = 0
        self._launch_limit = len(self.buckets)
        self._outer_task = None
        if root is not None and root.requires_grad:
            self._root_hook = root.register_hook(self._note_outer_task)

    def _note_outer_task(self, grad: torch.Tensor) -> None:
        self._outer_task = torch._C._current_graph_task_id()

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        """Note [gradient contributions]: a parameter's hook fires once per backward graph that reaches it. In
        one graph, autograd sums all uses first; but reentrant activation checkpointing (``use_reentrant=True``)
        recomputes each region and runs a nested backward for it, so a parameter used in k such regions fires k
        times. Contributions are added in staging; a bucket is reduced once every parameter brought as many
        as in the last backward. The first time a parameter's gradient comes from a nested backward, how many
        will follow is unknown: that bucket (and, to keep every rank's collectives in one order, the ones
        after it) waits for the end of backward. A contribution after its bucket's reduction started is refused."""
        if not self._reducing:
            return  # gradients accumulate in param.grad until the boundary
        index, position = self._owner[param]
        bucket = self.buckets[index]
        if index < self._next_launch:
            raise RuntimeError(
                f"rank {comm.get_rank()}: parameter '{self.param_names[param]}' received another gradient after "
                "its reduction had started: it is used again in a later part of backward (e.g. both inside and "
                "outside a reentrant activation checkpoint), whose gradient zeroshard cannot add any more. Use "
                "torch.utils.checkpoint.checkpoint(..., use_reentrant=False)"
            )
        nested = torch._C._current_graph_task_id() != self._outer_task
        if nested and bucket.expected[position] is None:
            self._launch_limit = min(self._launch_limit, index)
        was_complete = bucket.complete
        if self.check is not None:
            self.check.observe(index, position, param.grad)
        bucket.stage_grad(position, param.grad, next_to_reduce=index == self._next_launch)
        param.grad = None
        if bucket.complete and not was_complete and self.on_bucket_complete is not None:
            # only on becoming complete: a further recomputation, gathered again, still needs its weights. Freed
            # before the launch below draws a parked bucket's staging buffer, which may then reuse the gathered one
            self.on_bucket_complete(bucket.flat)
        self._launch_ready()

    def _launch_ready(self) -> None:
        """Reduce the buckets whose gradients are complete, strictly in bucket order so every rank issues the
        same sequence of collectives (even when ranks produce gradients in different orders or skip unused
        parameters). At most ``MAX_IN_FLIGHT`` reductions (none without ``overlap_comm``) stay pending, so
        staging memory is a few buckets, never the whole model's gradients."""
        limit = MAX_IN_FLIGHT if self.overlap_comm else 0
        while self._next_launch < self._launch_limit and self.buckets[self._next_launch].complete:
            bucket = self.buckets[self._next_launch]
            bucket.launch_reduce(self.predivide, self.overlap_comm, self.reduction, self.codec)
            self._in_flight.append(bucket)
            self._next_launch += 1
            while len(self._in_flight) > limit:
                self._finish_oldest()

    def _finish_oldest(self) -> None:
        summed_over = 1 if self.reduction is Reduction.LOCAL else self.gradient_group.size
        bucket = self._in_flight.popleft()
        bucket.finish_reduce(self.predivide / summed_over, final=self._boundary)
        if self._boundary and self.on_gradient_final is not None:
            self.on_gradient_final(self._index[id(bucket)])

    def end_backward(self) -> None:
        if self._root_hook is not None:
            self._root_hook.remove()  # a retained graph's next backward gets a fresh one
            self._root_hook = None
        if not self._reducing:
            return
        self._stage_accumulated()
        if not self.ignore_unused_parameters:
            self._refuse_unused()
        for bucket in self.buckets[self._next_launch :]:
            bucket.launch_reduce(self.predivide, True, self.reduction, self.codec)
            self._in_flight.append(bucket)
        while self._in_flight:
            self._finish_oldest()
        self._reducing = False

    def _stage_accumulated(self) -> None:
        """At the boundary of an accumulation reduced only there (stages 0-1), a parameter that an earlier
        micro-batch's backward reached but this last one did not (a branch taken earlier, the other model chunk of
        a DualPipeV rank) holds its accumulated gradient in ``.grad``, its hook never fired: staged now, as the
        hook would have, so it is reduced instead of counted as zero."""
        if self.reduce_every_micro_step:
            return
        for index in range(self._next_launch, len(self.buckets)):
            bucket = self.buckets[index]
            for position, param in enumerate(bucket.flat.params):
                if not bucket.arrived[position] and param.grad is not None:
                    if self.check is not None:
                        self.check.observe(index, position, param.grad)
                    bucket.stage_grad(position, param.grad, next_to_reduce=index == self._next_launch)
                    param.grad = None

    def _refuse_unused(self) -> None:
        """``ignore_unused_parameters: false`` (DeepSpeed's stage-3 check): a trainable parameter that received no
        gradient in this backward stops training on every rank (one small all-reduce agrees on it)."""
        unused = [
            self.param_names[param]
            for bucket in self.buckets[self._next_launch :]
            for param, arrived in zip(bucket.flat.params, bucket.arrived)
            if not arrived
        ]
        count = torch.tensor([len(unused)], dtype=torch.int64)
        comm.all_reduce(count, self.gradient_group, op="max")
        if count.item():
            where = f"{unused[:8]}{' ...' if len(unused) > 8 else ''}" if unused else "(on another rank)"
            raise UnusedParameterError(
                f"rank {comm.get_rank()}: parameters received no gradient in this backward {where}, and "
                "zero_optimization.ignore_unused_parameters is false; freeze them (requires_grad=False), use them, "
                "or set ignore_unused_parameters to true"
            )

    def verify_gradients(self, step: int) -> None:
        """``gradient_check``: raise by name on every rank when this step's reduction did not sum and average what
        backward produced (a collective on checked steps; Note [gradient check])."""
        if self.check is not None:
            self.check.verify(step, reduced=self.reduction is Reduction.EXACT)

    def zero_grad(self) -> None:
        if self.check is not None:
            self.check.reset()
        for bucket in self.buckets:
            bucket.home.clear()
            for param in bucket.flat.params:
                param.grad = None

    def bytes_held(self) -> dict[str, dict[str, int]]:
        grad_shard: dict[str, int] = {}
        for bucket in self.buckets:
            for where, nbytes in bucket.home.bytes().items():
                grad_shard[where] = grad_shard.get(where, 0) + nbytes
        return {"grad_shard": grad_shard, "staging": {"device": sum(b.staging_bytes() for b in self.buckets)}}

    def destroy(self) -> None:
        """Finish the reductions still in flight and remove the gradient hooks."""
        self.on_gradient_final = None  # no step follows
        while self._in_flight:
            self._finish_oldest()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def _nbytes(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.numel() * t.element_size()
