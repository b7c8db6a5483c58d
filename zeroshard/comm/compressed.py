"""Collectives that send compressed messages (:mod:`.compression`): 1-bit with error feedback (1-bit Adam's two
phases) and block-quantized int8/int4 (ZeRO++).

- ``compressed_reduce_scatter``: each rank compresses chunk j of its vector (plus, with error feedback, what its
  earlier compressions of that chunk dropped) and sends it to rank j, the chunk's owner ("server"), which sums the
  decompressed chunks with its own exact one, in fp32.
- ``compressed_all_gather``: each rank compresses its chunk (plus its own earlier error) and sends it to all; every
  rank, the sender included, takes the decompressed values, so all ranks hold the same vector afterwards.

``compressed_all_reduce`` chains the two into a 1-bit average. The ledger counts each at the bytes it sends,
payload and scales (op names ``reduce_scatter_1bit``, ``all_gather_int8``, ...).
"""

from __future__ import annotations

from typing import Optional

import torch

from .collectives import Pending, _exchange, _issue, _local, _skip, all_gather
from .compression import ONE_BIT, Codec, compress_with_feedback
from .groups import Group

_TAG_REDUCE_SCATTER = 3  # the point-to-point tags of zeroshard.comm.collectives use 1 and 2
_TAG_ALL_GATHER = 4


@torch.compiler.disable  # Note [collectives in compiled code] (graph_ops.py)
def compressed_reduce_scatter(
    input: torch.Tensor,
    error: Optional[torch.Tensor],
    group: Group,
    async_op: bool = False,
    codec: Codec = ONE_BIT,
) -> Pending:
    """Sum ``input`` (group.size equal chunks) across the group into this rank's chunk of ``input``; the other
    chunks go out compressed by ``codec``. ``error`` (fp32, (group.size - 1) x chunk), when given, keeps what the
    compression of each chunk this rank sends dropped (in group order, its own chunk left out), updated in place.
    The owner adds the chunks in fp32 when ``input`` is 16-bit."""
    n, me = group.size, group.rank
    op = f"reduce_scatter_{codec.name}"
    if _local(group):
        return _skip(op, group)  # this rank's chunk holds its own part already
    chunks = input.view(n, -1)
    numel = chunks.shape[1]
    outgoing = torch.empty(n, codec.message_nbytes(numel), dtype=torch.uint8, device=input.device)
    incoming = torch.empty_like(outgoing)
    others = [j for j in range(n) if j != me]
    sends, receives = {j: outgoing[j] for j in others}, {j: incoming[j] for j in others}
    for k, j in enumerate(others):
        if error is None:
            codec.compress(chunks[j], outgoing[j])
        else:
            compress_with_feedback(chunks[j], error.view(n - 1, numel)[k], outgoing[j], codec)

    def finish() -> None:
        received = torch.empty(numel, dtype=torch.float32, device=input.device)
        total = chunks[me].float() if chunks.dtype != torch.float32 else chunks[me]
        for j in others:
            total.add_(codec.decompress(incoming[j], numel, received))
        if total.data_ptr() != chunks[me].data_ptr():
            chunks[me].copy_(total)

    return _issue(
        op,
        group,
        outgoing,  # a whole vector's messages; this rank sends all but its own
        (n - 1) / n,
        lambda: _exchange(group, _TAG_REDUCE_SCATTER, sends, receives),
        async_op,
        finish,
    )


@torch.compiler.disable  # Note [collectives in compiled code] (graph_ops.py)
def compressed_all_gather(
    output: torch.Tensor,
    error: Optional[torch.Tensor],
    group: Group,
    async_op: bool = False,
    codec: Codec = ONE_BIT,
    input: Optional[torch.Tensor] = None,
    messages: Optional[torch.Tensor] = None,
) -> Pending:
    """Fill every chunk of ``output`` (group.size equal chunks) with the decompressed message of its owner: this
    rank's is ``input`` (default: its chunk of ``output``), compressed by ``codec``, with error feedback through
    ``error`` (fp32, one chunk) when given. The sender keeps what the others receive, so all ranks agree.
    ``messages`` (uint8, group.size x ``codec.message_nbytes(chunk)``), when given, receives the messages, for a
    caller that keeps the gathered vector compressed."""
    n, me = group.size, group.rank
    op = f"all_gather_{codec.name}"
    if _local(group):
        all_gather(output, output.view(n, -1)[me] if input is None else input, group)
        return _skip(op, group)
    chunks = output.view(n, -1)
    numel = chunks.shape[1]
    mine = chunks[me] if input is None else input.reshape(-1)
    if messages is None:
        messages = torch.empty(n, codec.message_nbytes(numel), dtype=torch.uint8, device=output.device)
    if error is None:
        codec.compress(mine, messages[me])
    else:
        compress_with_feedback(mine, error, messages[me], codec)
    codec.decompress(messages[me], numel, chunks[me])
    others = [j for j in range(n) if j != me]
    sends, receives = {j: messages[me] for j in others}, {j: messages[j] for j in others}

    def finish() -> None:
        for j in others:
            codec.decompress(messages[j], numel, chunks[j])

    return _issue(
        op,
        group,
        messages,
        (n - 1) / n,
        lambda: _exchange(group, _TAG_ALL_GATHER, sends, receives),
        async_op,
        finish,
    )


def all_reduce_error_numels(numel: int, group_size: int) -> tuple[int, int]:
    """Elements of the worker and server error ``compressed_all_reduce`` keeps for a ``numel``-element tensor."""
    chunk = -(-numel // group_size)
    return (group_size - 1) * chunk, chunk


@torch.compiler.disable  # Note [collectives in compiled code] (graph_ops.py)
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
