"""A process group as zeroshard sees it (its ranks, its torch handle, where its collectives count), and the
conversions from and to torch's ``ProcessGroup``. Which groups a run has is the mesh's business (``mesh.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._opaque_base import OpaqueBase

from ..accelerator import get_accelerator
from .backend import DEFAULT_TIMEOUT, get_rank, get_world_size
from .context import DEFAULT_CONTEXT, CommContext


@dataclass(frozen=True)
class Group(OpaqueBase):  # opaque to the compiler (Note [collectives in compiled code] in graph_ops.py)
    name: str
    ranks: tuple[int, ...]
    handle: Any  # the torch ProcessGroup; None means the default (world) group
    context: CommContext = field(default=DEFAULT_CONTEXT, compare=False, repr=False)  # where its collectives count
    # the world cut into groups like this one (the mesh's groups of the same dimensions, this one among them); a
    # group made alone is its own partition
    partition: tuple[tuple[int, ...], ...] = field(default=(), compare=False, repr=False)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def rank(self) -> int:
        """This process's index inside the group."""
        return self.ranks.index(get_rank())

    def counterpart(self, rank: int) -> int:
        """The member of this group standing where global rank ``rank`` stands in its own group of the partition:
        the rank whose coordinates along the dimensions this group spans are ``rank``'s, and whose others are this
        process's (e.g. in the gradient group under tensor parallelism, ``rank``'s peer holding this process's
        tensor-parallel pieces)."""
        if rank in self.ranks:
            return rank
        own = next((part for part in self.partition if rank in part), None)
        if own is None or len(own) != self.size:
            raise ValueError(
                f"rank {rank} is in no group of the {self.name} group's partition (its ranks: {list(self.ranks)})"
            )
        return self.ranks[own.index(rank)]


def world_group(context: CommContext = DEFAULT_CONTEXT) -> Group:
    """Every rank, as the default process group: what communicates before any engine's mesh exists (``zero.Init``,
    ``GatheredParameters`` on parameters no engine holds). An engine's collectives use its mesh's groups."""
    return Group("world", tuple(range(get_world_size())), None, context)


def solo_group(name: str, context: CommContext = DEFAULT_CONTEXT) -> Group:
    """This rank alone, named ``name``: a parallel dimension of size 1 (its collectives are skipped)."""
    return Group(name, (get_rank(),), None, context)


def group_of(handle: Any, name: str, context: CommContext = DEFAULT_CONTEXT) -> Group:
    """A torch ``ProcessGroup`` (``None`` or ``WORLD``: the world) as a zeroshard group, so collectives on it are
    counted and fail with an error naming the rank and operation."""
    if handle is None or handle is dist.group.WORLD:
        return Group(name, world_group(context).ranks, None, context)
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


def handle_timeout(handle: Any) -> timedelta:
    """The timeout a torch process group's collectives wait for (the default group's when ``handle`` is None)."""
    handle = handle if handle is not None else dist.group.WORLD
    try:
        return handle._get_backend(torch.device(get_accelerator().name)).options._timeout
    except (AttributeError, RuntimeError):  # a backend that does not say
        return DEFAULT_TIMEOUT


def group_timeout(group: Group) -> timedelta:
    """The timeout ``group``'s collectives wait for."""
    return handle_timeout(group.handle)


def new_process_group(ranks: list[int]) -> Any:
    """A torch process group of ``ranks`` (a collective call) that times out as the default group does: torch's
    ``new_group`` alone gives a Gloo group its own default of 30 minutes, whatever ``init_process_group`` was told."""
    return dist.new_group(ranks, timeout=handle_timeout(None))
