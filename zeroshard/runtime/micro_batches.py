"""What ``engine.train_batch`` reads and calls: one step's micro-batches, read before any runs and agreed on by the
ranks, and the loss in what the model returns."""

from __future__ import annotations

from typing import Any, Callable, Iterator, NamedTuple, Optional

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


class StepDoesNotFit(TrainBatchError, MemoryError):
    """A ``layer_major`` step's micro-batches keep more activations than some rank can allocate, measured before the
    step (``runtime/activation_fit.py``); refused on every rank, with the bytes, before anything runs."""


class StepMemory(NamedTuple):
    """One rank's count for a layer-major step: the bytes it needs (activations and gathered parameters), the bytes
    it can allocate, and of the first the activations, of this many micro-batches."""

    needed: int
    free: int
    activations: int
    micro_batches: int


def read_step(
    data_iter: Iterator,
    count: int,
    world: comm.Group,
    device: torch.device,
    measure: Optional[Callable[[list], Optional[StepMemory]]] = None,
) -> list:
    """The next ``count`` micro-batches of ``data_iter``. The ranks of ``world`` compare how many they read, and
    what ``measure`` says the step needs and can allocate (one all-gather of three numbers), so data that ends early
    on some rank is a :class:`DataExhausted`, and a step that does not fit some rank is a :class:`StepDoesNotFit`,
    on every rank, naming the ranks, before any collective of the step could wait for the rank that stopped."""
    batches = []
    try:
        while len(batches) < count:
            batches.append(next(data_iter))
    except StopIteration:
        pass
    memory = measure(batches) if measure is not None and len(batches) == count else None
    mine = torch.tensor([len(batches), *(memory[:2] if memory is not None else (0, 0))], dtype=torch.int64)
    table = torch.empty(world.size * 3, dtype=torch.int64, device=device)
    comm.all_gather(table, mine.to(device), world)
    rows = {rank: row for rank, row in zip(world.ranks, table.view(world.size, 3).tolist())}
    short = {rank: n for rank, (n, _, _) in rows.items() if n < count}
    if short:
        where = "every rank" if len(short) == world.size else f"ranks {sorted(short)}"
        raise DataExhausted(
            f"rank {comm.get_rank()}: train_batch(): the data iterator ended on {where} before the {count} "
            f"micro-batches of a step (micro-batches read per rank: {short}); nothing was trained on them. Wrap the "
            "iterator in RepeatingLoader (deepspeed.utils) or stop the loop at the end of an epoch"
        )
    over = {rank: (needed, free) for rank, (_, needed, free) in rows.items() if needed > free}
    if over:
        raise StepDoesNotFit(_does_not_fit(over, memory, count))
    return batches


def _does_not_fit(over: dict, memory: Optional[StepMemory], count: int) -> str:
    gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
    ranks = "; ".join(f"rank {r} needs {gib(need)} and can allocate {gib(free)}" for r, (need, free) in over.items())
    here = (
        f" (here: {gib(memory.activations)} of activations for {memory.micro_batches} micro-batches, the rest "
        "gathered parameters)"
        if memory is not None and comm.get_rank() in over
        else ""
    )
    return (
        f"rank {comm.get_rank()}: train_batch(): zero_optimization.layer_major keeps the activations of the step's "
        f"{count} micro-batches for backward at once, and they do not fit: {ranks}{here}. Nothing ran. Turn on "
        "activation checkpointing (each micro-batch then keeps only each checkpointed unit's input), lower "
        "gradient_accumulation_steps or train_micro_batch_size_per_gpu, or set layer_major to false (the "
        "micro-batch loop keeps one micro-batch's activations at a time)"
    )


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
