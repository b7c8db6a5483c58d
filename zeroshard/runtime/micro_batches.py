"""What ``engine.train_batch`` reads and calls: one step's micro-batches, read before any runs and agreed on by the
ranks, and the loss in what the model returns."""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch.utils._pytree import tree_map

from .. import comm


class DataExhausted(RuntimeError, StopIteration):
    """``train_batch``'s data iterator ended. At a batch boundary on every rank it is the end of the data (a
    ``StopIteration`` too, so a loop that stops on one stops); anywhere else the batch is refused on every rank,
    naming the ranks whose data ended, before anything is computed."""


class TrainBatchError(RuntimeError):
    """``train_batch`` cannot run this batch: no data, a step already begun with ``forward``/``backward``, or a
    model output without a loss."""


def read_step(data_iter: Iterator, count: int, world: comm.Group, device: torch.device) -> list:
    """The next ``count`` micro-batches of ``data_iter``. The ranks of ``world`` compare how many they read (one
    all-gather of a count), so data that ends early on some rank is a :class:`DataExhausted` on every rank, naming
    the ranks, before any collective of the step could wait for the rank that stopped."""
    batches = []
    try:
        while len(batches) < count:
            batches.append(next(data_iter))
    except StopIteration:
        pass
    read = torch.tensor([len(batches)], dtype=torch.int64, device=device)
    counts = torch.empty(world.size, dtype=torch.int64, device=device)
    comm.all_gather(counts, read, world)
    short = {rank: int(n) for rank, n in zip(world.ranks, counts.tolist()) if n < count}
    if short:
        where = "every rank" if len(short) == world.size else f"ranks {sorted(short)}"
        raise DataExhausted(
            f"rank {comm.get_rank()}: train_batch(): the data iterator ended on {where} before the {count} "
            f"micro-batches of a step (micro-batches read per rank: {short}); nothing was trained on them. Wrap the "
            "iterator in RepeatingLoader (deepspeed.utils) or stop the loop at the end of an epoch"
        )
    return batches


def loss_of(out: Any) -> torch.Tensor:
    """The loss in what a model returned (see ``train_batch``)."""
    if isinstance(out, dict) and "loss" in out:
        out = out["loss"]
    elif not torch.is_tensor(out) and getattr(out, "loss", None) is not None:
        out = out.loss
    elif isinstance(out, (tuple, list)) and out and torch.is_tensor(out[0]):
        out = out[0]
    if not torch.is_tensor(out) or out.numel() != 1 or not out.requires_grad:
        got = f"a tensor of shape {tuple(out.shape)}" if torch.is_tensor(out) else type(out).__name__
        raise TrainBatchError(
            f"rank {comm.get_rank()}: train_batch() needs the model to return its loss (a one-element tensor that "
            f"requires grad, an output with .loss, a dict with 'loss', or a tuple starting with it); it returned {got}"
        )
    return out


def describe(batch: Any) -> str:
    """A micro-batch's tensors by shape, for an error."""
    shapes = []
    tree_map(lambda v: shapes.append(tuple(v.shape)) if torch.is_tensor(v) else None, batch)
    return f"{type(batch).__name__} of tensors shaped {shapes[:8]}" if shapes else type(batch).__name__
