"""DeepSpeed's ``elasticity`` block: one global batch that stays valid as the world size changes.

The global batch is chosen once from the block (not from the current world size), so a restart at another
world size trains with the same batch; only the micro-batch and the gradient accumulation adapt. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .schema import ConfigError


@dataclass(frozen=True)
class ElasticBatch:
    train_batch_size: int
    valid_world_sizes: tuple[int, ...]


def _divisors(n: int) -> set[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return {*small, *(n // d for d in small)}


def valid_world_sizes(batch: int, micro_batch_sizes: list[int], min_gpus: int, max_gpus: int, gpus_per_node: int):
    """World sizes in [min_gpus, max_gpus] (whole nodes of ``gpus_per_node``) that split ``batch`` into micro-batches
    of one of the allowed sizes times a whole number of accumulation steps."""
    sizes = set()
    for micro in micro_batch_sizes:
        if batch % micro == 0:
            sizes |= {g for g in _divisors(batch // micro) if min_gpus <= g <= max_gpus and g % gpus_per_node == 0}
    return tuple(sorted(sizes))


def choose_batch(
    max_train_batch_size: int,
    micro_batch_sizes: list[int],
    min_gpus: int,
    max_gpus: int,
    prefer_larger_batch: bool = True,
    gpus_per_node: int = 1,
) -> ElasticBatch:
    """The global batch (at most ``max_train_batch_size``) valid for the most world sizes in the range; ties go to
    the larger batch (``prefer_larger_batch``, DeepSpeed's default) or the smaller.

    Counted as a sieve rather than batch by batch: a batch B is valid on world size g when B / g is a whole number
    of some micro-batch, so for each g the valid batches are g times the multiples of the micro-batch sizes. That
    costs about max_train_batch_size x log(max_gpus) additions (1e6 takes well under a second; testing every
    batch's divisors took 53 s)."""
    n = max_train_batch_size
    whole = torch.zeros(n + 1, dtype=torch.bool)  # whole[k]: k samples split into micro-batches of one size
    for micro in set(micro_batch_sizes):
        if micro <= n:
            whole[micro::micro] = True
    counts = torch.zeros(n + 1, dtype=torch.int32)  # counts[B]: world sizes on which batch B is valid
    first = -(-min_gpus // gpus_per_node) * gpus_per_node
    for g in range(first, min(max_gpus, n) + 1, gpus_per_node):
        counts[g::g] += whole[1 : n // g + 1]
    most = int(counts.max())
    if most == 0:
        raise ConfigError(
            f"elasticity: no global batch up to max_train_batch_size {max_train_batch_size} splits into "
            f"micro_batch_sizes {micro_batch_sizes} on any world size from min_gpus {min_gpus} to max_gpus {max_gpus}"
        )
    best = (counts == most).nonzero().flatten()
    batch = int(best[-1] if prefer_larger_batch else best[0])
    return ElasticBatch(batch, valid_world_sizes(batch, micro_batch_sizes, min_gpus, max_gpus, gpus_per_node))


def batch_of(block) -> ElasticBatch:
    """The elastic batch of a validated ``elasticity`` block (version 0.2 counts world sizes in whole nodes)."""
    per_node = block.num_gpus_per_node if block.version >= 0.2 else 1
    return choose_batch(
        block.max_train_batch_size,
        block.micro_batch_sizes,
        block.min_gpus,
        block.max_gpus,
        block.prefer_larger_batch,
        per_node,
    )


def micro_batch_for(batch: ElasticBatch, world_size: int, micro_batch_sizes: list[int]) -> tuple[int, int]:
    """(micro-batch size, gradient accumulation steps) for this world size: the largest allowed micro-batch. A world
    size the block does not allow (outside [min_gpus, max_gpus], or not whole nodes) is refused, as DeepSpeed does,
    even where the batch would divide."""
    if world_size not in batch.valid_world_sizes:
        raise ConfigError(
            f"elasticity: world size {world_size} cannot train the elastic global batch {batch.train_batch_size} with "
            f"micro_batch_sizes {micro_batch_sizes}; valid world sizes: {list(batch.valid_world_sizes)[:32]} (from "
            "min_gpus, max_gpus and num_gpus_per_node): start a valid number of ranks or change the elasticity block"
        )
    micro = max(m for m in micro_batch_sizes if batch.train_batch_size % (m * world_size) == 0)
    return micro, batch.train_batch_size // (micro * world_size)
