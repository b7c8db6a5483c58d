"""DeepSpeed's ``elasticity`` block: one global batch that stays valid as the world size changes.

The global batch is chosen once from the block (not from the current world size), so a restart at another
world size trains with the same batch; only the micro-batch and the gradient accumulation adapt. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass


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
    the larger batch (``prefer_larger_batch``, DeepSpeed's default) or the smaller."""
    best: ElasticBatch | None = None
    for batch in range(1, max_train_batch_size + 1):
        sizes = valid_world_sizes(batch, micro_batch_sizes, min_gpus, max_gpus, gpus_per_node)
        if not sizes:
            continue
        better = best is None or len(sizes) > len(best.valid_world_sizes)
        tie = best is not None and len(sizes) == len(best.valid_world_sizes)
        if better or (tie and prefer_larger_batch):
            best = ElasticBatch(batch, sizes)
    if best is None:
        raise ValueError(
            f"elasticity: no global batch up to max_train_batch_size {max_train_batch_size} splits into "
            f"micro_batch_sizes {micro_batch_sizes} on any world size from min_gpus {min_gpus} to max_gpus {max_gpus}"
        )
    return best


def micro_batch_for(batch: ElasticBatch, world_size: int, micro_batch_sizes: list[int]) -> tuple[int, int]:
    """(micro-batch size, gradient accumulation steps) for this world size: the largest allowed micro-batch."""
    for micro in sorted(micro_batch_sizes, reverse=True):
        if batch.train_batch_size % (micro * world_size) == 0:
            return micro, batch.train_batch_size // (micro * world_size)
    raise ValueError(
        f"elasticity: world size {world_size} cannot train the elastic global batch {batch.train_batch_size} with "
        f"micro_batch_sizes {micro_batch_sizes}; valid world sizes: {list(batch.valid_world_sizes)}"
    )
