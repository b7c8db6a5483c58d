"""Pure partitioning math: where each parameter lives in a flat buffer and which rank owns what.

Nothing here touches a process group or allocates a tensor, so all of it is unit-tested alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from .tensor_split import TensorSplit


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class Slot:
    """One parameter inside a flat buffer."""

    index: int  # position in the caller's parameter list
    name: str
    shape: tuple[int, ...]
    offset: int
    split: Optional[TensorSplit] = None  # how the whole parameter is cut over tensor- or expert-parallel ranks

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class Segment:
    """The part of one slot that falls inside one rank's shard."""

    slot: Slot
    shard_start: int  # offset inside the shard
    flat_start: int  # offset inside the flat buffer
    numel: int


@dataclass(frozen=True)
class FlatLayout:
    """Parameters packed back to back, padded so that ``shard_count`` ranks own equal contiguous slices."""

    slots: tuple[Slot, ...]
    shard_count: int

    @property
    def split_axis(self) -> Optional[str]:
        """The mesh dimension whose ranks hold different pieces of its parameters (``tp``: tensor-parallel pieces,
        ``ep``: experts), or None when they are replicated there; a flat group never mixes pieces of different axes
        or pieces and replicated parameters, so the first slot answers for all."""
        return self.slots[0].split.axis if self.slots and self.slots[0].split is not None else None

    @property
    def numel(self) -> int:
        return self.slots[-1].end if self.slots else 0

    @property
    def padded_numel(self) -> int:
        return round_up(max(self.numel, 1), self.shard_count)

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.shard_count

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    def shard_range(self, shard_rank: int) -> tuple[int, int]:
        if not 0 <= shard_rank < self.shard_count:
            raise ValueError(f"shard rank {shard_rank} outside [0, {self.shard_count})")
        start = shard_rank * self.shard_numel
        return start, start + self.shard_numel

    def segments(self, shard_rank: int) -> list[Segment]:
        """Which parameters (or parts of them) the shard of ``shard_rank`` holds."""
        lo, hi = self.shard_range(shard_rank)
        out = []
        for slot in self.slots:
            start, end = max(slot.offset, lo), min(slot.end, hi)
            if start < end:
                out.append(Segment(slot, start - lo, start, end - start))
        return out


def flat_layout(
    names: Sequence[str],
    shapes: Sequence[tuple[int, ...]],
    shard_count: int,
    indices: Sequence[int] | None = None,
    splits: Sequence[Optional[TensorSplit]] | None = None,
) -> FlatLayout:
    indices = range(len(names)) if indices is None else indices
    splits = [None] * len(names) if splits is None else splits
    if len({split is None for split in splits}) > 1:
        raise ValueError(f"a flat group mixes tensor-parallel pieces and replicated parameters: {list(names)}")
    slots, offset = [], 0
    for index, name, shape, split in zip(indices, names, shapes, splits):
        slot = Slot(index, name, tuple(shape), offset, split)
        slots.append(slot)
        offset = slot.end
    return FlatLayout(tuple(slots), shard_count)


def assign_buckets(numels: Sequence[int], bucket_size: int) -> list[list[int]]:
    """Split positions into consecutive buckets of at most ``bucket_size`` elements.

    A parameter larger than the bucket size gets a bucket of its own; 0 means one bucket for all.
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for position, numel in enumerate(numels):
        if current and bucket_size > 0 and filled + numel > bucket_size:
            buckets.append(current)
            current, filled = [], 0
        current.append(position)
        filled += numel
    if current:
        buckets.append(current)
    return buckets
