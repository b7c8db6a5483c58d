"""The collectives zeroshard issues, each counted in the ledger and bounded by a timeout.

Every function takes its :class:`Group` explicitly and returns a :class:`Pending` handle; a
synchronous call is one whose handle was already waited on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .backend import default_store, get_rank, get_world_size
from .groups import Group, group_timeout
from .trace import TraceEntry, diagnose

FORENSICS_WAIT_S = 10.0  # how long a failing rank waits for the other ranks' collective traces

# torch 2.13 renamed the flat-tensor collectives; older releases only have the *_tensor names.
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names the rank, the op, the group and, from the ranks'
    collective traces, the first rank and call site that diverged."""


def _failure(message: str, group: Group, entry: Optional[TraceEntry] = None) -> CollectiveError:
    store = default_store()
    verdict = None
    if store is not None:
        verdict = diagnose(store, get_rank(), get_world_size(), FORENSICS_WAIT_S, group.context.trace, entry)
    return CollectiveError(message + (f"\n  trace comparison: {verdict}" if verdict else ""))


@dataclass
class Pending:
    op: str
    group: Group
    work: Any  # torch Work, or None when nothing was sent (group of one)
    what: str
    started: float
    finish: Optional[Callable[[], None]] = None  # local work that completes the collective (see _gloo_*)
    entry: Optional[TraceEntry] = None  # this collective in the trace
    nbytes: int = 0  # message bytes
    wire_bytes: float = 0.0
    timeout: Optional[timedelta] = None  # what wait() allows when not told (a receive: its group's timeout)

    def wait(self, timeout: Optional[timedelta] = None) -> None:
        if self.work is None:
            return
        timeout = timeout if timeout is not None else self.timeout
        waiting = time.perf_counter()
        self.group.context.before_wait(self.op, self.started)
        try:
            if timeout is None:
                self.work.wait()
            else:
                self.work.wait(timeout)
        except RuntimeError as err:
            raise _failure(
                f"rank {get_rank()}: {self.op} on group '{self.group.name}' (ranks {list(self.group.ranks)}) "
                f"of {self.what} failed or timed out: {err}",
                self.group,
                self.entry,
            ) from err
        finally:
            seconds = time.perf_counter() - self.started
            if self.group.context.timing:
                caller = self.entry.site if self.entry is not None else None
                self.group.context.add_time(self.op, self.group.name, seconds, caller)
        if self.group.context.timing and self.group.context.each_op is not None:
            self.group.context.each_op(self.op, self.group.name, self.nbytes, self.wire_bytes, seconds)
        self.work = None
        if self.finish is not None:
            self.finish()
            self.finish = None
        self.group.context.add_wait(self.op, self.group.name, time.perf_counter() - waiting)


def _describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"


def _issue(
    op: str,
    group: Group,
    tensor: torch.Tensor,
    wire_factor: float,
    call,
    async_op: bool,
    finish: Optional[Callable[[], None]] = None,
    source: Optional[int] = None,
) -> Pending:
    if group.context.local_only():
        return _skip(op, group)  # compute-only (Note [compute-only runs]): a collective of no local form sends nothing
    nbytes = tensor.numel() * tensor.element_size()
    entry = group.context.record(op, group.name, nbytes, nbytes * wire_factor, tuple(tensor.shape), str(tensor.dtype))
    started = time.perf_counter()
    group.context.before_collective()  # a delayed collective (the delay seam) is waited for, as a slow one would be
    try:
        work = call()
    except RuntimeError as err:
        raise _failure(
            f"rank {get_rank()}: {op} on group '{group.name}' (ranks {list(group.ranks)}) of {_describe(tensor)} "
            f"failed: {err}",
            group,
            entry,
        ) from err
    group.context.add_wait(op, group.name, time.perf_counter() - started)  # issuing is the thread's time too
    what = _describe(tensor) + (f" from rank {source}" if source is not None else "")
    pending = Pending(op, group, work, what, started, finish, entry, nbytes, nbytes * wire_factor)
    if not async_op:
        pending.wait()
    return pending


def _skip(op: str, group: Group) -> Pending:
    return Pending(op, group, None, "", 0.0)


def _local(group: Group) -> bool:
    """Nothing leaves the rank: a group of one, or a compute-only run (Note [compute-only runs] in context.py), where
    each collective gives what a group of one would give, from this rank's own data: the work and memory traffic of
    the step stay, its communication goes (the results are not the real ones)."""
    return group.size == 1 or group.context.local_only()


@torch.compiler.disable  # Note [collectives in compiled code] (graph_ops.py)
def all_reduce(tensor: torch.Tensor, group: Group, op: str = "sum", async_op: bool = False) -> Pending:
    if _local(group):
        return _skip("all_reduce", group)
    reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
    n = group.size
    return _issue(
        "all_reduce",
        group,
        tensor,
        2 * (n - 1) / n,
        lambda: dist.all_reduce(tensor, op=reduce_op, group=group.handle, async_op=True),
        async_op,
    )


def _is_gloo(group: Group) -> bool:
    return dist.get_backend(group.handle) == "gloo"


# Point-to-point tags of the Gloo collectives below, one per kind, so that an all-gather and a reduce-scatter in
# flight at once between two ranks never take each other's messages (within a kind, every rank issues in one order).
_TAG_ALL_GATHER = 1
_TAG_REDUCE_SCATTER = 2


class _PointToPoint:
    """The sends and receives of one Gloo collective, waited for as one, each within ``timeout`` (the group's: a
    backend's point-to-point wait alone has none, and a peer that never joins would be waited for for ever)."""

    def __init__(self, works: list, timeout: timedelta):
        self.works, self.timeout = works, timeout

    def wait(self, timeout: Optional[timedelta] = None) -> None:
        for work in self.works:
            work.wait(timeout if timeout is not None else self.timeout)


def _exchange(group: Group, tag: int, sends: dict[int, torch.Tensor], receives: dict[int, torch.Tensor]):
    """Post every send and receive (keyed by the peer's index in the group) at once; nothing blocks."""
    works = [dist.irecv(t, group.ranks[j], group=group.handle, tag=tag) for j, t in receives.items()]
    works += [dist.isend(t, group.ranks[j], group=group.handle, tag=tag) for j, t in sends.items()]
    return _PointToPoint(works, group_timeout(group))


def reduce_scatter_scratch_numel(group: Group, numel: int) -> int:
    """Elements of scratch that ``reduce_scatter`` of a ``numel``-element input needs on ``group``: on Gloo the
    other ranks' chunks of this rank's part (see Note [gloo flat collectives]), elsewhere none. A caller that
    reuses buffers passes one as ``scratch=`` instead of letting each call allocate its own."""
    if group.size == 1 or not _is_gloo(group):
        return 0
    return numel // group.size * (group.size - 1)


@torch.compiler.disable  # Note [collectives in compiled code] (graph_ops.py)
def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Group,
    async_op: bool = False,
    scratch: Optional[torch.Tensor] = None,
) -> Pending:
    """Sum ``input`` (group.size x output.numel()) across the group; rank i keeps chunk i in ``output``, which may
    be that chunk of ``input`` itself. ``scratch``: see ``reduce_scatter_scratch_numel`` (held until the result
    is waited for)."""
    if _local(group):
        output.copy_(input.view(group.size, -1)[group.rank].view_as(output))
        return _skip("reduce_scatter", group)
    n = group.size
    if _is_gloo(group):
        # Note [gloo flat collectives]: Gloo's own reduce_scatter runs at half the speed of a whole all-reduce, and
        # its all-gather, or an all-to-all, needs a whole-size buffer besides input and output. Point-to-point
        # messages move exactly the collective's bytes (chunk j to rank j; our shard to every rank) at least as
        # fast, and need only a buffer for the chunks this rank receives; the sum is local.
        me, chunks = group.rank, input.view(n, -1)
        others = [j for j in range(n) if j != me]
        numel = (n - 1) * chunks.shape[1]
        if scratch is None:
            scratch = torch.empty(numel, dtype=input.dtype, device=input.device)
        received = dict(zip(others, scratch[:numel].view(n - 1, -1)))

        def finish() -> None:
            # elementwise adds in rank order, chunk after chunk: on CPU a dim-0 torch.sum runs 3x (fp32) to 10x
            # (bf16) slower. Same bits in fp32 and for two ranks; with more, bf16/fp16 chunks round at every add,
            # as a ring reduction (NCCL's) does at every hop. Our chunk, which ``output`` may be, is read before
            # ``output`` is written.
            parts = [chunks[me] if j == me else received[j] for j in range(n)]
            total = torch.add(parts[0], parts[1], out=output.view(-1) if me <= 1 else parts[0])
            for part in parts[2:]:
                total.add_(part)
            if me > 1:
                output.view(-1).copy_(total)

        return _issue(
            "reduce_scatter",
            group,
            input,
            (n - 1) / n,
            lambda: _exchange(group, _TAG_REDUCE_SCATTER, {j: chunks[j] for j in others}, received),
            async_op,
            finish,
        )
    return _issue(
        "reduce_scatter",
        group,
        input,
        (n - 1) / n,
        lambda: _reduce_scatter_flat(output, input, group=group.handle, async_op=True),
        async_op,
    )


@torch.compiler.disable  # Note [collectives in compiled code] (graph_ops.py)
def all_gather(output: torch.Tensor, input: torch.Tensor, group: Group, async_op: bool = False) -> Pending:
    """Concatenate every rank's ``input`` into ``output`` (group.size x input.numel()); ``input`` may be this
    rank's chunk of ``output`` itself."""
    if _local(group):
        for chunk in output.view(group.size, -1):
            if chunk.data_ptr() != input.data_ptr():
                chunk.copy_(input.reshape(-1))
        return _skip("all_gather", group)
    n = group.size
    if _is_gloo(group):
        # See Note [gloo flat collectives]: our shard goes to every rank by point-to-point sends, no scratch.
        me, chunks, flat = group.rank, output.view(n, -1), input.reshape(-1)
        if chunks[me].data_ptr() != flat.data_ptr():
            chunks[me].copy_(flat)
        others = [j for j in range(n) if j != me]
        return _issue(
            "all_gather",
            group,
            output,
            (n - 1) / n,
            lambda: _exchange(group, _TAG_ALL_GATHER, {j: flat for j in others}, {j: chunks[j] for j in others}),
            async_op,
        )
    return _issue(
        "all_gather",
        group,
        output,
        (n - 1) / n,
        lambda: _all_gather_flat(output, input, group=group.handle, async_op=True),
        async_op,
    )


@torch.compiler.disable  # Note [collectives in compiled code] (graph_ops.py)
def broadcast(tensor: torch.Tensor, src: int, group: Group, async_op: bool = False) -> Pending:
    """Copy ``tensor`` from global rank ``src`` to every rank of the group."""
    if _local(group):
        return _skip("broadcast", group)
    return _issue(
        "broadcast",
        group,
        tensor,
        1.0,
        lambda: dist.broadcast(tensor, src=src, group=group.handle, async_op=True),
        async_op,
    )


@torch.compiler.disable  # Note [collectives in compiled code] (graph_ops.py)
def reduce(tensor: torch.Tensor, dst: int, group: Group, op: str = "sum", async_op: bool = False) -> Pending:
    """Reduce ``tensor`` of every rank of the group into global rank ``dst``'s (the others' are left undefined)."""
    if _local(group):
        return _skip("reduce", group)
    reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
    return _issue(
        "reduce",
        group,
        tensor,
        1.0,
        lambda: dist.reduce(tensor, dst=dst, op=reduce_op, group=group.handle, async_op=True),
        async_op,
    )


@torch.compiler.disable  # Note [collectives in compiled code] (graph_ops.py)
def all_to_all(output: torch.Tensor, input: torch.Tensor, group: Group, async_op: bool = False) -> Pending:
    """Equal chunks of dim 0: chunk j of ``input`` goes to the group's j-th rank, which stores it as its chunk i."""
    if _local(group):
        output.copy_(input)
        return _skip("all_to_all", group)
    n = group.size
    return _issue(
        "all_to_all",
        group,
        input,
        (n - 1) / n,
        lambda: dist.all_to_all_single(output, input, group=group.handle, async_op=True),
        async_op,
    )


@torch.compiler.disable  # Note [collectives in compiled code] (graph_ops.py)
def all_to_all_uneven(
    output: torch.Tensor,
    input: torch.Tensor,
    output_splits: list[int],
    input_splits: list[int],
    group: Group,
    async_op: bool = False,
) -> Pending:
    """Chunks of dim 0 of any sizes: the ``input_splits[j]`` rows after the first ``sum(input_splits[:j])`` go to the
    group's j-th rank, and ``output_splits[j]`` rows arrive from it, in rank order (a count may be 0). The wire
    counts the rows this rank sends to other ranks."""
    if _local(group):
        kept = min(len(output), len(input))  # compute-only: the rows that fit, the rest zeros
        output[:kept].copy_(input[:kept])
        output[kept:].zero_()
        return _skip("all_to_all", group)
    rows = sum(input_splits)
    sent = rows - input_splits[group.rank]
    return _issue(
        "all_to_all",
        group,
        input,
        sent / rows if rows else 0.0,
        lambda: dist.all_to_all_single(output, input, output_splits, input_splits, group=group.handle, async_op=True),
        async_op,
    )


@torch.compiler.disable  # Note [collectives in compiled code] (graph_ops.py)
def gather(tensor: torch.Tensor, gather_list: Optional[list[torch.Tensor]], dst: int, group: Group) -> Pending:
    """Every rank's ``tensor`` into ``gather_list`` on global rank ``dst`` (``None`` elsewhere)."""
    if _local(group):
        for part in gather_list or ():
            part.copy_(tensor)
        return _skip("gather", group)
    return _issue(
        "gather",
        group,
        tensor,
        1.0,
        lambda: dist.gather(tensor, gather_list, dst=dst, group=group.handle, async_op=True),
        False,
    )


@torch.compiler.disable  # Note [collectives in compiled code] (graph_ops.py)
def scatter(tensor: torch.Tensor, scatter_list: Optional[list[torch.Tensor]], src: int, group: Group) -> Pending:
    """Global rank ``src``'s ``scatter_list[i]`` into the ``tensor`` of the group's i-th rank."""
    if _local(group):
        if scatter_list:
            tensor.copy_(scatter_list[group.rank])
        return _skip("scatter", group)
    return _issue(
        "scatter",
        group,
        tensor,
        1.0,
        lambda: dist.scatter(tensor, scatter_list, src=src, group=group.handle, async_op=True),
        False,
    )


@torch.compiler.disable  # Note [collectives in compiled code] (graph_ops.py)
def send(tensor: torch.Tensor, dst: int, group: Group, tag: int = 0, async_op: bool = False) -> Pending:
    """Point to point, to global rank ``dst``."""
    return _issue("send", group, tensor, 1.0, lambda: dist.isend(tensor, dst, group=group.handle, tag=tag), async_op)


@torch.compiler.disable  # Note [collectives in compiled code] (graph_ops.py)
def recv(tensor: torch.Tensor, src: int, group: Group, tag: int = 0, async_op: bool = False) -> Pending:
    """Point to point, from global rank ``src``; it waits no longer than the group's collectives do (a backend's
    receive alone would wait for ever on a sender stuck elsewhere), and its error names ``src``."""
    pending = _issue(
        "recv", group, tensor, 0.0, lambda: dist.irecv(tensor, src, group=group.handle, tag=tag), True, source=src
    )
    pending.timeout = group_timeout(group)
    if not async_op:
        pending.wait()
    return pending


@torch.compiler.disable  # Note [collectives in compiled code] (graph_ops.py)
def post_send(tensor: torch.Tensor, dst: int, group: Group, tag: int = 0, wait_s: float = 30.0) -> bool:
    """A send its receiver may never take (the word that a pipeline stage stopped, to a neighbour that may have
    stopped too): waited for at most ``wait_s`` seconds; False when it was not taken by then, or could not be posted
    (the peer is gone). Counted as a send; its failure is expected, not diagnosed."""
    if group.context.local_only():
        return True
    nbytes = tensor.numel() * tensor.element_size()
    group.context.record("send", group.name, nbytes, float(nbytes), tuple(tensor.shape), str(tensor.dtype))
    try:
        dist.isend(tensor, dst, group=group.handle, tag=tag).wait(timedelta(seconds=wait_s))
    except RuntimeError:
        return False
    return True


@torch.compiler.disable  # Note [collectives in compiled code] (graph_ops.py)
def barrier(group: Group) -> None:
    if not _local(group):
        entry = group.context.record("barrier", group.name, 0, 0.0, (), "")
        started = time.perf_counter()
        try:
            dist.barrier(group=group.handle)
        except RuntimeError as err:
            raise _failure(
                f"rank {get_rank()}: barrier on group '{group.name}' failed or timed out: {err}", group, entry
            ) from err
        group.context.add_wait("barrier", group.name, time.perf_counter() - started)
