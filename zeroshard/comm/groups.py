"""Process groups derived from one rank grid.

Ranks are laid out as ``arange(world).view(replicas, shard_size)``: a row is a *shard group*
(ranks that split parameters and optimizer state), a column a *replica group* (ranks holding the
same shard). Plain ZeRO is one row: the shard group is the whole data-parallel world.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist

from .backend import get_rank, get_world_size


@dataclass(frozen=True)
class Group:
    name: str
    ranks: tuple[int, ...]
    handle: Any  # the torch ProcessGroup; None means the default (world) group

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def rank(self) -> int:
        """This process's index inside the group."""
        return self.ranks.index(get_rank())


@dataclass(frozen=True)
class RankGrid:
    world: Group
    shard: Group
    replica: Group

    @property
    def data_parallel_size(self) -> int:
        return self.world.size


def grid_layout(world_size: int, shard_size: Optional[int]) -> list[list[int]]:
    """Rows of the rank grid (each row one shard group). Pure, so it is testable without processes."""
    shard_size = shard_size or world_size
    if shard_size < 1 or world_size % shard_size:
        raise ValueError(
            f"shard group size {shard_size} must divide the world size {world_size} "
            "(zero_hpz_partition_size / mics_shard_size)"
        )
    return [list(range(start, start + shard_size)) for start in range(0, world_size, shard_size)]


def build_rank_grid(shard_size: Optional[int] = None) -> RankGrid:
    """Create the groups every rank must create together (collective call)."""
    world_size, rank = get_world_size(), get_rank()
    rows = grid_layout(world_size, shard_size)
    world = Group("world", tuple(range(world_size)), None)
    if len(rows) == 1:
        # a replica group of one needs no process group: collectives on a group of one are skipped
        return RankGrid(world=world, shard=Group("shard", world.ranks, None), replica=Group("replica", (rank,), None))
    shard = replica = None
    for row in rows:  # every rank takes part in creating every group
        handle = dist.new_group(row)
        if rank in row:
            shard = Group("shard", tuple(row), handle)
    for col in zip(*rows):
        handle = dist.new_group(list(col))
        if rank in col:
            replica = Group("replica", tuple(col), handle)
    return RankGrid(world=world, shard=shard, replica=replica)


def build_tensor_parallel_group(tp_size: int) -> Group:
    """Consecutive ranks in groups of ``tp_size`` (a collective call; every rank creates every group)."""
    world_size, rank = get_world_size(), get_rank()
    if tp_size > world_size or world_size % tp_size:
        raise ValueError(
            f"tensor_parallel.tp_size {tp_size} must divide the number of ranks {world_size}: "
            f"launch with a multiple of {tp_size} processes (e.g. zeroshard --num_gpus {tp_size} ...)"
        )
    rows = grid_layout(world_size, tp_size)
    if len(rows) == 1:
        return Group("tensor", tuple(rows[0]), None)
    mine = None
    for row in rows:
        handle = dist.new_group(row) if tp_size > 1 else None
        if rank in row:
            mine = Group("tensor", tuple(row), handle)
    return mine
