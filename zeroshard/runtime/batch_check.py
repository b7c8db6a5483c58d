"""Every rank must run the same batch settings, and every rank of a tensor-parallel group the same batch.

The settings (micro-batch size, accumulation steps) decide when each rank reduces gradients and steps: ranks that
differ (a config built per rank from its own arguments) would wait in different collectives, so ``initialize``
compares them once and names the ranks that differ. A tensor-parallel group's ranks compute one model's forward
together, each on its pieces: a data loader sharded by global rank instead of data-parallel rank breaks this
silently (the loss still falls); the engine checks once, at the first forward, and names the ranks that differ."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from .. import comm


class BatchMismatchError(ValueError):
    """Ranks were given different batch settings, or ranks of one tensor-parallel group different batches."""


def check_same_batch_settings(micro_batch_size: int, accumulation_steps: int, world: comm.Group) -> None:
    """Raise :class:`BatchMismatchError` on every rank when the ranks' micro-batch sizes or accumulation steps differ
    (one small all-gather)."""
    mine = torch.tensor([micro_batch_size, accumulation_steps], dtype=torch.int64)
    everyone = mine.new_empty(world.size * 2)
    comm.all_gather(everyone, mine, world)
    rows = everyone.view(world.size, 2).tolist()
    for column, key in enumerate(("train_micro_batch_size_per_gpu", "gradient_accumulation_steps")):
        values = {}
        for rank, row in zip(world.ranks, rows):
            values.setdefault(row[column], []).append(rank)
        if len(values) > 1:
            listing = "; ".join(f"{value} on rank(s) {ranks}" for value, ranks in sorted(values.items()))
            raise BatchMismatchError(
                f"the ranks resolved different {key} ({listing}): every rank must run the same batch settings, or "
                "they wait in different collectives; give every rank the same config"
            )


def fingerprint(inputs: Any) -> torch.Tensor:
    """Four float64 numbers that differ, in practice, between different batches: the tensor count, the elements,
    their sum, and a sum weighted by position (so a permutation differs too)."""
    tensors = [t for t in tree_flatten(inputs)[0] if torch.is_tensor(t)]
    total = torch.zeros(4, dtype=torch.float64)
    total[0] = len(tensors)
    for index, tensor in enumerate(tensors, start=1):
        values = tensor.detach().reshape(-1).to("cpu", torch.float64)
        total[1] += values.numel()
        total[2] += values.sum()
        total[3] += index * (values * torch.arange(1, values.numel() + 1, dtype=torch.float64)).sum()
    return total


def check_same_batch(inputs: Any, group: comm.Group) -> None:
    """Raise :class:`BatchMismatchError` on every rank of ``group`` when their ``inputs`` differ (collective)."""
    mine = fingerprint(inputs)
    everyone = mine.new_empty(group.size * mine.numel())
    comm.all_gather(everyone, mine, group)
    rows = everyone.view(group.size, -1)
    differing = [rank for rank, row in zip(group.ranks, rows) if not torch.equal(row, rows[0])]
    if differing:
        raise BatchMismatchError(
            f"rank {group.ranks[0]} and rank {differing[0]} of tensor-parallel group {list(group.ranks)} got different "
            "batches at the first forward: every rank of a tensor-parallel group must see the same batch. Shard the "
            "data by data-parallel rank (engine.mesh.gradient.rank, deepspeed.utils.groups.get_data_parallel_rank()), "
            "not by global rank, or pass training_data= to initialize"
        )
