"""Collectives that send 1-bit compressed messages (:mod:`.compression`), in two phases as 1-bit Adam does:

- ``compressed_reduce_scatter``: each rank compresses chunk j of its vector (plus what its earlier compressions of
  that chunk dropped) and sends it to rank j, the chunk's "server", which sums the decompressed chunks with its own
  exact one.
- ``compressed_all_gather``: each rank compresses its chunk (plus its own earlier error) and sends it to all; every
  rank, the sender included, takes the decompressed values, so all ranks hold the same vector afterwards.

``compressed_all_reduce`` chains the two into an average. The ledger counts each at the bytes it sends, packed
signs and scales (op names ``reduce_scatter_1bit`` and ``all_gather_1bit``).
"""

from __future__ import annotations

import torch

from .collectives import Pending, _exchange, _issue, _skip
from .compression import compress_with_feedback, decompress, message_nbytes
from .groups import Group

_TAG_REDUCE_SCATTER_1BIT = 3  # the point-to-point tags of zeroshard.comm.collectives use 1 and 2
_TAG_ALL_GATHER_1BIT = 4


def compressed_reduce_scatter(
    input: torch.Tensor, error: torch.Tensor, group: Group, async_op: bool = False
) -> Pending:
    """Sum ``input`` (group.size equal chunks) across the group into this rank's chunk of ``input``; the other
    chunks go out 1-bit compressed. ``error`` (fp32, (group.size - 1) x chunk) keeps what the compression of each
    chunk this rank sends dropped (in group order, its own chunk left out) and is updated in place."""
    n, me = group.size, group.rank
    if n == 1:
        return _skip("reduce_scatter_1bit", group)
    chunks = input.view(n, -1)
    numel = chunks.shape[1]
    outgoing = torch.empty(n, message_nbytes(numel), dtype=torch.uint8, device=input.device)
    incoming = torch.empty_like(outgoing)
    others = [j for j in range(n) if j != me]
    sends, receives = {j: outgoing[j] for j in others}, {j: incoming[j] for j in others}
    for row, j in zip(error.view(n - 1, numel), others):
        compress_with_feedback(chunks[j], row, outgoing[j])

    def finish() -> None:
        received = torch.empty(numel, dtype=torch.float32, device=input.device)
        for j in others:
            chunks[me].add_(decompress(incoming[j], numel, received))

    return _issue(
        "reduce_scatter_1bit",
        group,
        outgoing,  # a whole vector's messages; this rank sends all but its own
        (n - 1) / n,
        lambda: _exchange(group, _TAG_REDUCE_SCATTER_1BIT, sends, receives),
        async_op,
        finish,
    )


def compressed_all_gather(output: torch.Tensor, error: torch.Tensor, group: Group, async_op: bool = False) -> Pending:
    """Replace every chunk of ``output`` (group.size equal chunks, this rank's own filled in) with the decompressed
    message of its owner, sent 1-bit compressed with error feedback through ``error`` (fp32, one chunk)."""
    n, me = group.size, group.rank
    if n == 1:
        return _skip("all_gather_1bit", group)
    chunks = output.view(n, -1)
    numel = chunks.shape[1]
    messages = torch.empty(n, message_nbytes(numel), dtype=torch.uint8, device=output.device)
    compress_with_feedback(chunks[me], error, messages[me])
    decompress(messages[me], numel, chunks[me])  # the sender keeps what the others receive
    others = [j for j in range(n) if j != me]
    sends, receives = {j: messages[me] for j in others}, {j: messages[j] for j in others}

    def finish() -> None:
        for j in others:
            decompress(messages[j], numel, chunks[j])

    return _issue(
        "all_gather_1bit",
        group,
        messages,
        (n - 1) / n,
        lambda: _exchange(group, _TAG_ALL_GATHER_1BIT, sends, receives),
        async_op,
        finish,
    )


def all_reduce_error_numels(numel: int, group_size: int) -> tuple[int, int]:
    """Elements of the worker and server error ``compressed_all_reduce`` keeps for a ``numel``-element tensor."""
    chunk = -(-numel // group_size)
    return (group_size - 1) * chunk, chunk


def compressed_all_reduce(
    tensor: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor, group: Group
) -> None:
    """Average the fp32 ``tensor`` across the group in place: compressed reduce-scatter (``worker_error``), the
    server's mean plus its ``server_error``, compressed all-gather. Every rank ends with the same values."""
    n = group.size
    if n == 1:
        return
    chunk = all_reduce_error_numels(tensor.numel(), n)[1]
    flat = tensor.view(-1)
    padded = flat if flat.numel() == n * chunk else torch.cat([flat, flat.new_zeros(n * chunk - flat.numel())])
    compressed_reduce_scatter(padded, worker_error, group)
    padded.view(n, -1)[group.rank].div_(n)
    compressed_all_gather(padded, server_error, group)
    if padded.data_ptr() != flat.data_ptr():
        flat.copy_(padded[: flat.numel()])


class OneBitAllReduce:
    """Averages tensors across ``group`` with ``compressed_all_reduce``, owning each tensor's worker and server
    errors between calls (a tensor is named by the caller's ``key``)."""

    def __init__(self, group: Group):
        self.group = group
        self._errors: dict[object, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, tensor: torch.Tensor, key: object) -> None:
        errors = self._errors.get(key)
        if errors is None:
            worker, server = all_reduce_error_numels(tensor.numel(), self.group.size)
            errors = self._errors[key] = (
                torch.zeros(worker, dtype=torch.float32, device=tensor.device),
                torch.zeros(server, dtype=torch.float32, device=tensor.device),
            )
        compressed_all_reduce(tensor, *errors, self.group)

    def reset(self) -> None:
        """Forget the errors (after a checkpoint load, as DeepSpeed does: they are per rank and world size)."""
        self._errors.clear()

    def nbytes(self) -> int:
        return sum(w.numel() * 4 + s.numel() * 4 for w, s in self._errors.values())
