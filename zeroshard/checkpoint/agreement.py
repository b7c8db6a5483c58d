"""Cross-rank agreement around a checkpoint: every rank saves into one directory under one tag, and a failure on
any rank (a full disk, a damaged file) makes every rank raise, naming the failing ranks, instead of stranding the
others in a collective. The same small collectives choose the auto-resume point (``resume.py``)."""

from __future__ import annotations

import os
import shutil
import warnings
from typing import Optional

import torch

from .. import comm
from .commit import read_latest
from .safetensors_io import CheckpointError

_TEXT_BYTES = 4096  # a path or an error message, exchanged between ranks


class RankDisagreementError(ValueError, AssertionError):
    """The ranks called ``save_checkpoint`` with different tags or directories. An ``AssertionError`` too, because
    DeepSpeed asserts there and its clients' tests expect that class."""


def ranks_agree(save_dir: str, tag: str, world: comm.Group, tag_validation: str) -> str:
    """Every rank must write into one directory (a path built from each rank's clock or hostname would split
    a checkpoint in pieces): compare the absolute paths before anything is written. Differing tags are
    refused, warned about or ignored as ``checkpoint.tag_validation`` says (DeepSpeed's key; rank 0's tag
    names the checkpoint)."""
    pairs = [text.split("\n", 1) for text in gather_text(f"{os.path.abspath(save_dir)}\n{tag}", world)]
    paths, tags = [p[0] for p in pairs], [p[-1] for p in pairs]
    if len(set(tags)) > 1 and tag_validation != "ignore":
        listing = ", ".join(f"rank {r}: {t!r}" for r, t in enumerate(tags))
        message = f"save_checkpoint: the ranks pass different tags ({listing})"
        if tag_validation == "fail":
            raise RankDisagreementError(message + '; pass one tag on every rank (checkpoint.tag_validation is "Fail")')
        warnings.warn(message + f"; the checkpoint is saved as rank 0's tag {tags[0]!r}", stacklevel=4)
    if len(set(paths)) > 1:
        listing = ", ".join(f"rank {r}: {p}" for r, p in enumerate(paths))
        raise RankDisagreementError(
            f"save_checkpoint: the ranks name different save directories ({listing}); every rank must pass the "
            "same save_dir (build it once, e.g. on rank 0, and share it)"
        )
    return tags[0]


def gather_text(text: str, world: comm.Group) -> list[str]:
    """Every rank's ``text`` (cut at ``_TEXT_BYTES`` bytes), in rank order: one small all-gather."""
    if world.size == 1:
        return [text]
    mine = text.encode()[:_TEXT_BYTES]
    local = torch.zeros(_TEXT_BYTES, dtype=torch.uint8)
    local[: len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8) if mine else local[:0]
    every = torch.empty(world.size * _TEXT_BYTES, dtype=torch.uint8)
    comm.all_gather(every, local, world)
    rows = every.view(world.size, _TEXT_BYTES)
    return [bytes(row.tolist()).rstrip(b"\x00").decode(errors="replace") for row in rows]


def failed_ranks(error: Optional[Exception], world: comm.Group) -> list[int]:
    """The ranks whose ``error`` is set (one small all-reduce, so every rank knows them all)."""
    return [r for r, code in enumerate(_codes(1 if error is not None else 0, world)) if code == 1]


def _codes(code: int, world: comm.Group) -> list[int]:
    """Every rank's ``code``, in rank order (one small all-reduce)."""
    codes = torch.zeros(world.size)
    codes[comm.get_rank()] = float(code)
    comm.all_reduce(codes, world)
    return [int(c) for c in codes.tolist()]


def agree_on_write(world: comm.Group, error: Optional[OSError], save_dir: str, tmp: str) -> None:
    """After each writing phase: if any rank failed (disk full, permissions), every rank raises, the partial
    ``.tmp`` directory is removed, and the checkpoint that ``latest`` names is untouched."""
    ranks = failed_ranks(error, world)
    if not ranks:
        return
    if comm.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    kept = read_latest(save_dir)
    kept_text = f"the previous checkpoint '{kept}' is kept" if kept else "no earlier checkpoint was there"
    cause = f"{error.strerror or error} ({error.filename or tmp})" if error is not None else "see those ranks' errors"
    raise CheckpointError(
        f"saving a checkpoint into {save_dir} failed on rank(s) {ranks}: {cause}; the partial save was removed "
        f"and {kept_text}"
    )


def agree_on_load(world: comm.Group, error: Optional[CheckpointError], path: str, found: bool = True) -> None:
    """Every rank raises if any rank failed to open, check or read its part: the failing ranks with their own
    message, the others with the first failing rank's (so every rank's log names the file and field). ``found``:
    whether this rank found a checkpoint to load at all; ranks that disagree (a ``latest`` on some nodes' disks
    only) raise too, instead of some loading while others start fresh."""
    codes = _codes(1 if error is not None else 0 if found else 2, world)
    ranks = [r for r, code in enumerate(codes) if code == 1]
    if ranks:
        messages = gather_text(str(error) if error is not None else "", world)
        if error is not None:
            raise error
        raise CheckpointError(f"loading {path} failed on rank(s) {ranks}: rank {ranks[0]}: {messages[ranks[0]]}")
    absent = [r for r, code in enumerate(codes) if code == 2]
    if absent and len(absent) < world.size:
        raise CheckpointError(
            f"{path}: rank(s) {absent} find no checkpoint there and the others do (no 'latest' on their disk); every "
            "rank must read the same directory (shared storage, or copy it to every node)"
        )
