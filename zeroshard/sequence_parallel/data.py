"""Feeding Ulysses: every rank's loader yields its own samples, and the ranks of a sequence-parallel group compute
each of them together, one sample after another.

Per batch the loader yields, the ranks of the group exchange their batches; the adapter then yields P micro-batches:
the i-th holds this rank's 1/P of the tokens of rank i's batch. Labels are shifted before the cut
(``shift_labels[t] = labels[t + 1]``, ``-100`` after the last token), so the label of the first token of the next
piece is not lost at a piece's edge, and ``labels`` is dropped: a model given the local piece of ``labels`` would
shift it again inside the piece. ``position_ids`` are required: each rank's tokens keep their places in the whole
sequence (Ulysses attention checks them).

Tensors are cut along dimension 1 ([batch, tokens, ...]); other values must be plain data (JSON: numbers, strings,
lists, dicts, None) and are copied. Batches are exchanged as tensors and a JSON header: nothing is unpickled.
"""

from __future__ import annotations

import json
from collections import deque
from typing import Any, Iterable, Iterator, Optional

import torch

from .. import comm

IGNORE_INDEX = -100


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """``labels`` moved one token left along dim 1, ``-100`` after the last token (the target of token t is t+1)."""
    return torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].contiguous()


class UlyssesSPDataLoaderAdapter:
    """Wraps a loader whose batches are dicts with ``input_ids``, ``position_ids`` and ``labels`` (or
    ``shift_labels``) of shape [batch, tokens, ...]; yields ``sequence_parallel_size`` micro-batches per batch (see
    the module docstring). DeepSpeed's signature; ``sp_group`` is a torch ``ProcessGroup`` or a zeroshard group."""

    def __init__(self, dl: Iterable, sp_rank: int, sp_group: Any, sp_world_size: int, device: Any = None):
        self.group = comm.as_group(sp_group, "sequence")
        if self.group.size != sp_world_size or self.group.rank != sp_rank:
            raise ValueError(
                f"UlyssesSPDataLoaderAdapter: sp_rank {sp_rank} / sp_world_size {sp_world_size} disagree with the "
                f"group given (this rank is {self.group.rank} of {self.group.size})"
            )
        self.dl, self.device = dl, torch.device(device) if device is not None else torch.device("cpu")
        self._iter: Iterator = iter(dl)
        self._pieces: deque = deque()

    def __len__(self) -> int:
        return len(self.dl) * self.group.size

    def __iter__(self) -> "UlyssesSPDataLoaderAdapter":
        return self

    def __next__(self) -> dict:
        if not self._pieces:
            try:
                batch = next(self._iter)
            except StopIteration:
                self._iter = iter(self.dl)  # the next epoch starts from a fresh iterator, as DeepSpeed's
                raise
            self._pieces.extend(self._cut(batch))
        return self._pieces.popleft()

    def _cut(self, batch: Any) -> list[dict]:
        try:
            batch, refused = _checked(batch), None
        except (TypeError, ValueError) as err:  # still exchanged, so every rank raises instead of one hanging
            batch, refused = {}, err
        batches = exchange_batches(batch, self.group, self.device, refused)
        return [_piece(whole, self.group.rank, self.group.size) for whole in batches]


def _checked(batch: Any) -> dict:
    if not isinstance(batch, dict):
        raise TypeError(f"UlyssesSPDataLoaderAdapter: batches must be dicts of tensors, got {type(batch).__name__}")
    missing = [key for key in ("input_ids", "position_ids") if key not in batch]
    if "labels" not in batch and "shift_labels" not in batch:
        missing.append("labels")
    if missing:
        raise ValueError(
            f"UlyssesSPDataLoaderAdapter: the batch has no {missing} (keys: {sorted(batch)}); position_ids give each "
            "token its place in the whole sequence once it is cut (torch.arange(tokens) per row for unpacked data)"
        )
    tokens = batch["input_ids"].shape[1]
    for key, value in batch.items():
        if torch.is_tensor(value) and (value.dim() < 2 or value.shape[1] != tokens):
            raise ValueError(
                f"UlyssesSPDataLoaderAdapter: {key} has shape {list(value.shape)}; every tensor must be [batch, "
                f"{tokens} tokens, ...] like input_ids"
            )
    return batch


def exchange_batches(
    batch: dict, group: comm.Group, device: torch.device, refused: Optional[Exception] = None
) -> list[dict]:
    """Every rank's ``batch``, in rank order (a collective over ``group``): tensors of any length along dim 1,
    plain values through JSON. A batch this rank ``refused`` (or one whose values are not plain data) is still
    announced in the header, so every rank raises, naming the rank, instead of the others waiting on it."""
    try:
        values = {k: _plain(k, v) for k, v in batch.items() if not torch.is_tensor(v)}
    except TypeError as err:
        refused, values = refused or err, {}
    header = {
        "tensors": {
            k: [list(v.shape), str(v.dtype).removeprefix("torch.")] for k, v in batch.items() if torch.is_tensor(v)
        },
        "values": values,
        "refused": None if refused is None else str(refused),
    }
    headers = [json.loads(raw) for raw in _gather_bytes(json.dumps(header).encode(), group, device)]
    if refused is not None:
        raise refused
    for rank, other in enumerate(headers):
        if other["refused"] is not None:
            raise ValueError(f"sequence-parallel rank {rank}'s batch was refused there: {other['refused']}")
    keys = [sorted(h["tensors"]) + sorted(h["values"]) for h in headers]
    if any(k != keys[0] for k in keys):
        raise ValueError(f"UlyssesSPDataLoaderAdapter: the ranks' batches have different keys: {keys}")
    out: list[dict] = [dict(h["values"]) for h in headers]
    for key in sorted(header["tensors"]):
        shapes = [h["tensors"][key][0] for h in headers]
        dtypes = [h["tensors"][key][1] for h in headers]
        for rank, dtype in enumerate(dtypes):  # every rank sees the same headers: all raise together
            if dtype != dtypes[0]:
                raise ValueError(
                    f"UlyssesSPDataLoaderAdapter: batch entry {key!r} is {dtype} on sequence-parallel rank {rank} "
                    f"and {dtypes[0]} on rank 0; every rank's loader must give the same dtypes"
                )
        longest = max(shape[1] for shape in shapes)
        if any(shape[:1] + shape[2:] != shapes[0][:1] + shapes[0][2:] for shape in shapes):
            raise ValueError(f"UlyssesSPDataLoaderAdapter: {key} differs beyond its length across ranks: {shapes}")
        local = batch[key].to(device)
        padded = torch.nn.functional.pad(local, _pad_dim1(local, longest - local.shape[1]))
        gathered = padded.new_empty((group.size, *padded.shape))
        comm.all_gather(gathered, padded.contiguous(), group)
        for rank, shape in enumerate(shapes):
            out[rank][key] = gathered[rank].narrow(1, 0, shape[1])
    return out


def _piece(whole: dict, rank: int, ranks: int) -> dict:
    """This rank's tokens of one batch, labels shifted before the cut."""
    whole = dict(whole)
    if "labels" in whole:
        labels = whole.pop("labels")
        if "shift_labels" not in whole:  # the loader's own shifted labels win
            whole["shift_labels"] = shift_labels(labels)
    tokens = whole["input_ids"].shape[1]
    if tokens % ranks:
        raise ValueError(
            f"UlyssesSPDataLoaderAdapter: a batch of {tokens} tokens does not divide over sequence_parallel_size "
            f"{ranks}; pad sequences to a multiple of {ranks} (e.g. the collator's pad_to_multiple_of)"
        )
    step = tokens // ranks
    return {k: v.narrow(1, rank * step, step).cpu() if torch.is_tensor(v) else v for k, v in whole.items()}


def _pad_dim1(t: torch.Tensor, extra: int) -> tuple:
    """``F.pad`` widths that add ``extra`` entries at the end of dim 1 (pad lists dims from the last)."""
    return (0, 0) * (t.dim() - 2) + (0, extra)


def _plain(key: str, value: Any) -> Any:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        raise TypeError(
            f"UlyssesSPDataLoaderAdapter: batch entry {key!r} is a {type(value).__name__}; entries that are not "
            "tensors must be plain data (numbers, strings, lists, dicts, None)"
        ) from None
    return value


def _gather_bytes(data: bytes, group: comm.Group, device: torch.device) -> list[bytes]:
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = size.new_empty((group.size, 1))
    comm.all_gather(sizes, size, group)
    longest = int(sizes.max())
    local = torch.zeros(longest, dtype=torch.uint8, device=device)
    local[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    gathered = local.new_empty((group.size, longest))
    comm.all_gather(gathered, local, group)
    return [bytes(gathered[r, : int(sizes[r])].tolist()) for r in range(group.size)]


__all__ = ["UlyssesSPDataLoaderAdapter", "exchange_batches", "shift_labels"]
