"""How one parameter is cut over the ranks of a tensor-parallel group: pure tensor arithmetic, no communication.

A :class:`TensorSplit` describes a piece in terms of the *full* tensor as the model defines it (a Hugging Face
``Conv1D`` weight is (in, out), a ``Linear`` weight (out, in)): the full tensor is cut along ``dim`` into ``parts``
equal pieces, rank ``index`` keeping the ``index``-th. A *fused* tensor packs ``fused`` projections side by side
along ``dim`` (GPT-2's ``c_attn`` holds q, k and v): each projection is cut on its own and a rank's piece is the
concatenation of its slice of each, so every rank keeps whole heads of all of them. A ``transposed`` piece is
stored transposed (the tensor-parallel layers hold every weight as (out, in)).

Expert parallelism cuts a fused experts tensor (``[E, ...]``) the same way along its expert dimension, over the
expert-parallel ranks: ``axis`` names the mesh dimension the pieces lie along (``tp`` or ``ep``).

Checkpoints record the split of every parameter, so a piece saved at one tensor- or expert-parallel degree can be
joined to the full tensor and cut again at another.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AXES = ("tp", "ep")


@dataclass(frozen=True)
class TensorSplit:
    dim: int  # the dim of the full tensor that is cut
    parts: int  # tensor-parallel ranks
    fused: int = 1  # projections packed side by side along ``dim``, each cut separately
    transposed: bool = False  # the piece is stored transposed (2-D tensors only)
    axis: str = "tp"  # the mesh dimension whose ranks hold the pieces: tensor (tp) or expert (ep) parallelism
    # one tensor per expert (a ModuleList of experts, DeepSpeed's MoE layer): rank r's copy i is expert r * L + i, a
    # separate tensor, not a slice of a stack (planning treats it as a piece of its axis; checkpoints and
    # consolidation name each copy by its global expert index instead of joining pieces)
    listed: bool = False

    def __post_init__(self):
        if self.parts < 1 or self.fused < 1 or self.dim < 0 or self.axis not in AXES:
            raise ValueError(f"invalid tensor split {self}")

    def check(self, full_shape: tuple[int, ...], what: str) -> None:
        """Refuse a full shape this split cannot cut evenly, naming ``what`` (the parameter)."""
        if self.dim >= len(full_shape) or (self.transposed and len(full_shape) != 2):
            raise ValueError(f"{what}: shape {list(full_shape)} has no dim {self.dim} to split")
        size = full_shape[self.dim]
        if size % (self.fused * self.parts):
            fused = f" in {self.fused} fused parts" if self.fused > 1 else ""
            raise ValueError(f"{what}: dim {self.dim} of size {size}{fused} is not divisible by {self.parts} ranks")

    def piece_shape(self, full_shape: tuple[int, ...]) -> tuple[int, ...]:
        shape = list(full_shape)
        shape[self.dim] //= self.parts
        return tuple(reversed(shape)) if self.transposed else tuple(shape)

    def full_shape(self, piece_shape: tuple[int, ...]) -> tuple[int, ...]:
        shape = list(reversed(piece_shape)) if self.transposed else list(piece_shape)
        shape[self.dim] *= self.parts
        return tuple(shape)

    def piece(self, full: torch.Tensor, index: int) -> torch.Tensor:
        """Rank ``index``'s piece of ``full`` (a new tensor when fused or transposed; else a view)."""
        part = full.shape[self.dim] // self.fused
        per = part // self.parts
        slices = [full.narrow(self.dim, k * part + index * per, per) for k in range(self.fused)]
        piece = torch.cat(slices, self.dim) if self.fused > 1 else slices[0]
        return piece.t() if self.transposed else piece

    def join(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's piece, in rank order."""
        if len(pieces) != self.parts:
            raise ValueError(f"a tensor split over {self.parts} ranks joins {self.parts} pieces, got {len(pieces)}")
        pieces = [p.t() if self.transposed else p for p in pieces]
        per = pieces[0].shape[self.dim] // self.fused
        return torch.cat([p.narrow(self.dim, k * per, per) for k in range(self.fused) for p in pieces], self.dim)

    def as_record(self) -> dict:
        """What a checkpoint manifest stores (``axis`` only when it is not tensor parallelism's)."""
        record = {"dim": self.dim, "parts": self.parts, "fused": self.fused, "transposed": self.transposed}
        return record if self.axis == "tp" else {**record, "axis": self.axis}

    @classmethod
    def from_record(cls, record: dict) -> "TensorSplit":
        keys = {"dim", "parts", "fused", "transposed"}
        if not isinstance(record, dict) or not keys <= set(record) <= keys | {"axis"}:
            raise ValueError(f"a tensor split record needs dim, parts, fused and transposed (and axis), got {record!r}")
        axis = record.get("axis", "tp")
        if axis not in AXES:
            raise ValueError(f"a tensor split record's axis is one of {list(AXES)}, got {axis!r}")
        ints = [record[k] for k in ("dim", "parts", "fused")]
        flag = record["transposed"]
        if any(isinstance(v, bool) or not isinstance(v, int) for v in ints) or not isinstance(flag, bool):
            raise ValueError(f"a tensor split record holds integers and a boolean, got {record!r}")
        return cls(record["dim"], record["parts"], record["fused"], record["transposed"], axis)


def linear_splits(style: str, parts: int, fused: int = 1, transposed: bool = False, bias: bool = True) -> dict:
    """How a linear layer's parameters (``weight``, ``bias``) are cut over ``parts`` ranks: a column-parallel layer
    cuts its output features (the bias too), a row-parallel one its input features (the bias stays whole).
    ``transposed``: the weight is stored (in, out), as Hugging Face's ``Conv1D``."""
    if style == "column":
        out = {"weight": TensorSplit(1 if transposed else 0, parts, fused, transposed)}
        return {**out, "bias": TensorSplit(0, parts, fused)} if bias else out
    if style == "row":
        return {"weight": TensorSplit(0 if transposed else 1, parts, 1, transposed)}
    raise ValueError(f"a linear layer is split as 'column' or 'row', not {style!r}")
