"""The checkpoint manifest: which bytes of which file hold which part of which parameter (pure data).

Every parameter is described by its fully qualified name, global shape and a list of *pieces*:
(file, tensor key, offset in that tensor, offset in the flattened parameter, element count). Saved
shard ranges are derived from the layouts of the run that saved; a loader with another world size
or stage reads, for each of its own shard segments, exactly the pieces that overlap it.
"""

from __future__ import annotations

from dataclasses import dataclass

FORMAT = "zeroshard-checkpoint/1"


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


@dataclass(frozen=True)
class Piece:
    file: str
    key: str  # tensor key without the state prefix, e.g. "fg3"
    tensor_offset: int
    param_offset: int
    numel: int

    def to_json(self) -> list:
        return [self.file, self.key, self.tensor_offset, self.param_offset, self.numel]

    @classmethod
    def from_json(cls, value: list) -> "Piece":
        return cls(*value)


def pieces_for(layout, flat_key: str, writer_files: list[str]) -> dict[str, list[Piece]]:
    """Pieces of every parameter of one flat group, given the file that holds each shard."""
    out: dict[str, list[Piece]] = {}
    for shard_rank, file in enumerate(writer_files):
        for seg in layout.segments(shard_rank):
            out.setdefault(seg.slot.name, []).append(
                Piece(file, flat_key, seg.shard_start, seg.flat_start - seg.slot.offset, seg.numel)
            )
    return out


def overlapping(pieces: list[Piece], start: int, stop: int):
    """(piece, tensor slice, destination slice) for each saved piece overlapping [start, stop) of a parameter."""
    for piece in pieces:
        lo, hi = max(start, piece.param_offset), min(stop, piece.param_offset + piece.numel)
        if lo < hi:
            src = piece.tensor_offset + (lo - piece.param_offset)
            yield piece, (src, src + hi - lo), (lo - start, hi - start)
