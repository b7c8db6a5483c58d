"""Process groups derived from one rank grid.

Two axes, in DeepSpeed's order (:func:`parallel_layout`): *tensor-parallel groups* are consecutive ranks
(``tp_rank = rank % tp``), *data-parallel groups* stride by ``tp`` (``dp_rank = rank // tp``). Inside a
data-parallel group, ranks are laid out as ``arange(dp).view(replicas, shard_size)``: a row is a *shard group*
(ranks that split parameters and optimizer state), a column a *replica group* (ranks holding the same shard).
Plain ZeRO is one tensor-parallel rank and one row: the shard group is the whole data-parallel world.

*Sequence-parallel groups* (Ulysses) are consecutive ranks too. They split each sample's tokens, not the model, so
they stay inside the data-parallel group: ZeRO shards and reduces over data x sequence ranks (DeepSpeed's
"sequence data parallel" group), and only the batch arithmetic counts ``data / sequence`` data-parallel ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch.distributed as dist

from .backend import get_rank, get_world_size
from .context import DEFAULT_CONTEXT, CommContext


@dataclass(frozen=True)
class Group:
    name: str
    ranks: tuple[int, ...]
    handle: Any  # the torch ProcessGroup; None means the default (world) group
    context: CommContext = field(default=DEFAULT_CONTEXT, compare=False, repr=False)  # where its collectives count

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
    data: Group  # this rank's data-parallel group: the ranks that see different batches (the world without TP)
    tensor: Group  # this rank's tensor-parallel group: the ranks that split its layers (this rank alone without TP)
    sequence: Group  # this rank's sequence-parallel group: the ranks that split each sample's tokens (inside `data`)
    sequence_adopted: bool = False  # built before the grid (register_with_transformers): its owner tears it down

    @property
    def data_parallel_size(self) -> int:
        """Data-parallel ranks as the batch arithmetic counts them: the ranks of a sequence-parallel group together
        compute one sample (DeepSpeed's ``train_batch_size`` counts world / (tp x sp))."""
        return self.data.size // self.sequence.size

    @property
    def tensor_parallel_size(self) -> int:
        return self.tensor.size

    @property
    def context(self) -> CommContext:
        """Where the grid's collectives are counted (one context for all its groups)."""
        return self.world.context


def grid_layout(world_size: int, shard_size: Optional[int]) -> list[list[int]]:
    """Rows of the rank grid (each row one shard group). Pure, so it is testable without processes."""
    shard_size = shard_size or world_size
    if shard_size < 1 or world_size % shard_size:
        raise ValueError(
            f"shard group size {shard_size} must divide the world size {world_size} "
            "(zero_hpz_partition_size / mics_shard_size)"
        )
    return [list(range(start, start + shard_size)) for start in range(0, world_size, shard_size)]


@dataclass(frozen=True)
class ParallelLayout:
    """Every group of the grid on both axes, as global rank lists (each list is one group)."""

    tensor: list[list[int]]
    data: list[list[int]]
    shard: list[list[int]]
    replica: list[list[int]]
    sequence: list[list[int]]


def parallel_layout(
    world_size: int, tp_size: int = 1, shard_size: Optional[int] = None, sp_size: int = 1
) -> ParallelLayout:
    """The groups of ``world_size`` ranks with ``tp_size``-way tensor parallelism, ``sp_size``-way sequence
    parallelism and ZeRO shard groups of ``shard_size`` ranks inside each data-parallel group (see the module
    docstring). Pure."""
    if tp_size < 1 or world_size % tp_size:
        raise ValueError(
            f"tensor_parallel.autotp_size {tp_size} must divide the number of ranks {world_size}: launch with a "
            f"multiple of {tp_size} processes"
        )
    if sp_size < 1 or world_size % sp_size:
        raise ValueError(
            f"sequence_parallel_size {sp_size} must divide the number of ranks {world_size}: launch with a "
            f"multiple of {sp_size} processes"
        )
    if tp_size > 1 and sp_size > 1:
        raise ValueError(
            f"tensor_parallel.autotp_size {tp_size} with sequence_parallel_size {sp_size}: combining tensor and "
            "sequence parallelism is not supported; use one of them"
        )
    tensor = [list(range(start, start + tp_size)) for start in range(0, world_size, tp_size)]
    data = [list(range(tp_rank, world_size, tp_size)) for tp_rank in range(tp_size)]
    rows = grid_layout(world_size // tp_size, shard_size)  # positions inside one data-parallel group
    shard = [[group[i] for i in row] for group in data for row in rows]
    replica = [[group[i] for i in column] for group in data for column in zip(*rows)]
    sequence = [list(range(start, start + sp_size)) for start in range(0, world_size, sp_size)]
    return ParallelLayout(tensor, data, shard, replica, sequence)


def _own_group(name: str, partition: list, world_size: int, context: CommContext = DEFAULT_CONTEXT) -> Group:
    """This rank's part of ``partition`` (rank lists covering the world) as a group. Every rank calls this
    with the same partition: creating a process group is collective over the world. A part that is the
    whole world uses the default group; a part of one rank needs none (its collectives are skipped)."""
    rank, mine = get_rank(), None
    for part in map(tuple, partition):
        handle = dist.new_group(list(part)) if 1 < len(part) < world_size else None
        if rank in part:
            mine = Group(name, part, handle, context)
    return mine


def build_rank_grid(
    shard_size: Optional[int] = None,
    context: Optional[CommContext] = None,
    tp_size: int = 1,
    sp_size: int = 1,
    sequence: Optional[Group] = None,
) -> RankGrid:
    """Create the groups every rank must create together (collective call). Their collectives count in
    ``context`` (by default a new child of the process's default context). ``sequence``: a sequence-parallel
    group built before the engine (by ``register_with_transformers``), adopted when it has the layout's ranks."""
    context = context or DEFAULT_CONTEXT.child()
    world_size = get_world_size()
    layout = parallel_layout(world_size, tp_size, shard_size, sp_size)
    world = Group("world", tuple(range(world_size)), None, context)
    if sequence is not None and list(sequence.ranks) not in layout.sequence:
        raise ValueError(
            f"the sequence-parallel group {list(sequence.ranks)} given is not one of {layout.sequence}: "
            f"sequence_parallel_size {sp_size} groups consecutive ranks"
        )
    return RankGrid(
        world=world,
        shard=_own_group("shard", layout.shard, world_size, context),
        replica=_own_group("replica", layout.replica, world_size, context),
        data=_own_group("data", layout.data, world_size, context) if tp_size > 1 else world,
        tensor=_own_group("tensor", layout.tensor, world_size, context),
        sequence=sequence or _own_group("sequence", layout.sequence, world_size, context),
        sequence_adopted=sequence is not None,
    )


def group_of(handle: Any, name: str, context: CommContext = DEFAULT_CONTEXT) -> Group:
    """A torch ``ProcessGroup`` (``None`` or ``WORLD``: the world) as a zeroshard group, so collectives on it are
    counted and fail with an error naming the rank and operation."""
    if handle is None or handle is dist.group.WORLD:
        return Group(name, tuple(range(get_world_size())), None, context)
    if not isinstance(handle, dist.ProcessGroup):
        raise TypeError(
            f"the {name} group: expected a torch ProcessGroup, a zeroshard group or None (the world), got "
            f"{type(handle).__name__}"
        )
    return Group(name, tuple(dist.get_process_group_ranks(handle)), handle, context)


def as_group(group: Any, name: str) -> Group:
    """``group`` as a zeroshard group: itself, or a torch ``ProcessGroup`` / ``None`` through :func:`group_of`
    (DeepSpeed's clients pass what ``mpu`` returns)."""
    return group if isinstance(group, Group) else group_of(group, name)


def process_group(group: Group) -> Any:
    """The torch ``ProcessGroup`` behind ``group``, for clients that call ``torch.distributed`` themselves (DeepSpeed's
    ``groups`` getters). A group of this rank alone has none (zeroshard skips its collectives)."""
    if group.handle is not None:
        return group.handle
    if group.size == get_world_size():
        return dist.group.WORLD
    raise ValueError(
        f"the {group.name} group is rank {group.ranks[0]} alone, which needs no process group: its size is 1 and "
        "this rank's index in it 0"
    )


def destroy_groups(grid: RankGrid) -> None:
    """Tear down the process groups ``build_rank_grid`` created (the default group stays: it is not ours)."""
    if not dist.is_initialized():
        return
    built = {grid.shard, grid.replica, grid.data, grid.tensor} | (set() if grid.sequence_adopted else {grid.sequence})
    for group in built:
        if group.handle is not None:
            dist.destroy_process_group(group.handle)


def build_tensor_parallel_group(tp_size: int) -> Group:
    """Consecutive ranks in groups of ``tp_size`` (a collective call)."""
    world_size = get_world_size()
    if world_size % tp_size:
        raise ValueError(
            f"tensor_parallel.tp_size {tp_size} must divide the number of ranks {world_size}: "
            f"launch with a multiple of {tp_size} processes (e.g. zeroshard --num_gpus {tp_size} ...)"
        )
    return _own_group("tensor", grid_layout(world_size, tp_size), world_size)
