"""The :class:`~zeroshard.optim.contract.ShardLayout` of an optimizer state's master shards: where each parameter
lies in them, and the collectives that complete a parameter's norms or make its matrix whole.

A parameter's elements are spread over two kinds of ranks: the shard group (ZeRO: each rank a contiguous range of
the flat group) and, when the parameter is a piece of the model's (tensor or expert parallelism), the ranks holding
the other pieces: the flat group's *split axis* (``FlatLayout.split_axis``), whose group the mesh names
(``Mesh.pieces``). A norm is completed over the first, then the second; a matrix is gathered over the first, then
its pieces joined by the slot's own :class:`~zeroshard.partition.TensorSplit` (which also cuts the result back).
Flat groups of expert parameters shard over another group than the dense ones (``expert_shard``): each set of
columns is reduced over its own groups, every rank making the same calls in the same order.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch

from .. import comm
from ..offload import SubGroup
from ..optim.contract import MatrixPiece, ShardLayout
from ..partition import Slot
from .flat_group import FlatGroup


class FlatShardLayout(ShardLayout):
    """The layout of master shards that are each one flat group's whole shard (see the module). ``pieces``: the
    group along each split axis (``tp``, ``ep``)."""

    def __init__(self, flats: list[FlatGroup], subgroups: list[SubGroup], pieces: Mapping[str, comm.Group]):
        self._flat_of: dict[int, FlatGroup] = {}
        self._segments: dict[int, list[tuple[int, int, int]]] = {}
        columns: list[tuple[Optional[comm.Group], Optional[comm.Group]]] = []  # per slot: (shard, pieces) groups
        first_column = {}
        self._joined: dict[int, list[Optional[comm.Group]]] = {}  # per flat group, per slot: its pieces' group
        for flat in flats:
            first_column[id(flat)] = len(columns)
            shard_group = flat.shard_group if flat.partitioned else None
            self._joined[id(flat)] = [_joined_over(slot, pieces) for slot in flat.layout.slots]
            columns += [(shard_group, joined) for joined in self._joined[id(flat)]]
        for sub in subgroups:
            flat = flats[sub.flat_index]
            self._flat_of[id(sub.param)] = flat
            base = first_column[id(flat)]
            self._segments[id(sub.param)] = [
                (base + flat.layout.slots.index(seg.slot), seg.shard_start, seg.numel)
                for seg in flat.layout.segments(flat.shard_rank)
            ]
        self._columns = columns
        self._reductions = _reductions(columns)
        several = flats and not flats[0].partitioned and flats[0].shard_group.size > 1  # stage 0, several ranks
        self.compressed = comm.OneBitAllReduce(flats[0].shard_group) if several else None

    @property
    def slot_count(self) -> int:
        return len(self._columns)

    def segments(self, tensor: torch.Tensor) -> list[tuple[int, int, int]]:
        return self._segments[id(tensor)]

    def complete_norms(self, partial: torch.Tensor) -> None:
        """Over each column's shard group, then its split axis: one all-reduce per distinct group, over the columns
        that need it (every column at once when they all do)."""
        for group, mask in self._reductions:
            if mask is None:
                comm.all_reduce(partial, group)
                continue
            index = mask.to(partial.device)
            summed = partial[:, index].contiguous()
            comm.all_reduce(summed, group)
            partial[:, index] = summed

    def matrices(self, tensor: torch.Tensor, values: torch.Tensor) -> list[MatrixPiece]:
        flat = self._flat_of[id(tensor)]
        whole = flat.whole_of(values.to(flat.device))  # the flat group's values (this rank's pieces)
        joined = self._joined[id(flat)]
        group = next(filter(None, joined), None)
        rows = [whole]
        if group is not None:  # every piece along the split axis, in rank order (one all-gather per flat group)
            gathered = whole.new_empty(group.size * whole.numel())
            comm.all_gather(gathered, whole.contiguous(), group)
            rows = list(gathered.view(group.size, -1))
        start = flat.layout.shard_range(flat.shard_rank)[0] if flat.partitioned else 0
        stop = start + tensor.numel()
        out = []
        for slot, pieces_group in zip(flat.layout.slots, joined):
            lo, hi = max(slot.offset, start), min(slot.end, stop)
            if lo < hi:
                split = pieces_group is not None
                out.append(_matrix(slot, rows if split else [whole], group.rank if split else 0, lo, hi, start))
        return out


def _reductions(columns: list[tuple]) -> list[tuple[comm.Group, Optional[torch.Tensor]]]:
    """The all-reduces that complete the norms of ``columns`` ((shard group, split-axis group) per slot): the shard
    groups first, then the split axes', each distinct group (by name: the same order on every rank, flat groups are
    ordered alike) with the mask of its columns, None when it is every column."""
    out = []
    for which in (0, 1):
        names = list(dict.fromkeys(c[which].name for c in columns if c[which] is not None and c[which].size > 1))
        for name in names:
            mask = [c[which] is not None and c[which].name == name for c in columns]
            group = next(c[which] for c, chosen in zip(columns, mask) if chosen)
            out.append((group, None if all(mask) else torch.tensor(mask)))
    return out


def _joined_over(slot: Slot, pieces: Mapping[str, comm.Group]) -> Optional[comm.Group]:
    """The group whose ranks hold the other pieces of ``slot``'s parameter, or None when this rank holds it whole
    (replicated, one rank along the axis, or one expert of a list: each its own tensor)."""
    split = slot.split
    if split is None or split.listed:
        return None
    group = pieces.get(split.axis)
    return group if group is not None and group.size > 1 else None


def _matrix(slot: Slot, rows: list[torch.Tensor], index: int, lo: int, hi: int, shard_start: int) -> MatrixPiece:
    """Slot ``slot`` made whole from every piece (``rows``: each rank's flat group along the split axis, or this
    rank's alone), and the cut of a whole-shaped result back to this rank's piece, then to the flat group's range
    ``[lo, hi)`` (the shard's from ``shard_start``)."""
    pieces = [row[slot.offset : slot.end].view(slot.shape) for row in rows]
    whole = slot.split.join(pieces) if len(pieces) > 1 else pieces[0]

    def local(result: torch.Tensor) -> torch.Tensor:
        piece = slot.split.piece(result, index) if len(pieces) > 1 else result
        return piece.reshape(-1)[lo - slot.offset : hi - slot.offset]

    return MatrixPiece(whole, lo - shard_start, hi - shard_start, local)


__all__ = ["FlatShardLayout"]
