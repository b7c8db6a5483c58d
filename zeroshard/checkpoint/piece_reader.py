"""Reading one rank's piece of a saved parameter for ``load``: from the flat groups' pieces a checkpoint holds
(resharded when the tensor- or expert-parallel degree changed), or from the whole tensor among the module's tensors
(a frozen parameter saved below stage 3)."""

from __future__ import annotations

from typing import Optional

import torch

from .manifest import Piece, piece_dtype, saved_split
from .reading import Sources, assemble, read_parameter
from .view import TrainingState


class PieceReader:
    """Elements [start, stop) of this rank's piece of a saved parameter, flattened. A parameter saved and loaded at
    the same tensor- (expert-) parallel degree (or replicated in both runs) is read straight from the pieces that
    overlap; otherwise the whole saved parameter is joined and this rank's piece cut from it (kept for the next
    segment)."""

    def __init__(self, sources: Sources, state: TrainingState):
        self.sources, self.splits = sources, state.tensor_splits
        self.piece_index = {"tp": state.mesh.tensor.rank, "ep": state.mesh.expert.rank}  # this rank's, per axis
        rank = state.mesh.expert.rank
        self.global_names = {local: names[rank] for local, names in state.expert_names.items()}
        self._cached: tuple[Optional[tuple[str, str]], Optional[torch.Tensor]] = (None, None)
        self._parsed: dict[str, tuple] = {}  # name -> (pieces, their dtype, saved split): read once per parameter

    def saved_name(self, name: str) -> str:
        """The name a parameter is saved under: its own, or for one of a layer's experts, its global one."""
        return self.global_names.get(name, name)

    def _entry(self, name: str) -> tuple:
        if name not in self._parsed:
            entry = self.sources.manifest["params"][name]
            pieces = [Piece.from_json(p) for p in entry["pieces"]]
            self._parsed[name] = (pieces, piece_dtype(self.sources.manifest, name, pieces[0].key), saved_split(entry))
        return self._parsed[name]

    def saved(self, local: str) -> bool:
        """Whether the checkpoint holds the values of the parameter this model names ``local``: as a parameter (a flat
        group's, with its pieces), or whole among the module's tensors (a frozen parameter saved below stage 3)."""
        name = self.saved_name(local)
        return name in self.sources.manifest["params"] or name in self.sources.manifest["module_tensors"]

    def __call__(self, local: str, prefix: str, start: int, stop: int, out: torch.Tensor) -> None:
        """Of the parameter this model names ``local`` (saved as ``saved_name(local)``); a parameter saved whole among
        the module's tensors has its values as ``master`` and no optimizer state."""
        name = self.saved_name(local)
        mine = None if local in self.global_names else self.splits.get(local)  # one expert: whole, as saved
        if name not in self.sources.manifest["params"]:
            if prefix != "master":  # frozen when saved: its optimizer state starts at zero, as for a new parameter
                out.zero_()
                return
            if self._cached[0] != (name, prefix):
                whole = self.sources.read_whole(name, self.sources.manifest["module_tensors"][name]).float()
                piece = mine.piece(whole, self.piece_index[mine.axis]) if mine is not None else whole
                self._cached = ((name, prefix), piece.reshape(-1).clone())
            out.copy_(self._cached[1][start:stop])
            return
        pieces, dtype, saved = self._entry(name)
        entry = self.sources.manifest["params"][name]
        if saved == mine:  # both whole, or cut alike over as many ranks: this rank's piece is saved as it is
            shift = (
                0 if mine is None else self.piece_index[mine.axis] * (torch.Size(entry["shape"]).numel() // mine.parts)
            )
            assemble(self.sources, pieces, prefix, dtype, shift + start, shift + stop, out)
            return
        if self._cached[0] != (name, prefix):
            whole = read_parameter(self.sources, name, prefix)
            piece = mine.piece(whole, self.piece_index[mine.axis]) if mine is not None else whole
            self._cached = ((name, prefix), piece.reshape(-1).clone())
        out.copy_(self._cached[1][start:stop])


__all__ = ["PieceReader"]
