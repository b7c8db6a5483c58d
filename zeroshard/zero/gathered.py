"""Whole-parameter access under ZeRO: ``GatheredParameters`` and unit-by-unit consolidation."""

from __future__ import annotations

from typing import Iterable, Mapping, Optional

import torch

from .. import comm
from ..accelerator import get_accelerator
from ..partition import TensorSplit
from .flat_group import FlatGroup, ParamState
from .materialize import creation_order, materialize_pending, put_back
from .sharded_param import records_of


class GatheredParameters:
    """Gather the given parameters on enter and re-partition them on exit (a no-op for whole parameters).

    With ``modifier_rank`` the values that rank holds at exit are broadcast and kept, master weights
    included, also when the block raised on any rank (as DeepSpeed does: every rank then still holds one model,
    and none waits in a broadcast another skipped); without it, changes made inside the context are discarded.
    Every rank must enter the context together (it issues collectives) with the same ``modifier_rank``, which
    they check on entering. Parameters built under ``zero.Init`` and not yet handed to ``initialize`` get their
    data here (see :mod:`zeroshard.zero.init`), so a pretrained-weight load into them is kept.
    """

    def __init__(self, params, modifier_rank: Optional[int] = None, enabled: bool = True):
        world = comm.get_world_size()
        if modifier_rank is not None and (
            isinstance(modifier_rank, bool) or not isinstance(modifier_rank, int) or not 0 <= modifier_rank < world
        ):
            raise ValueError(
                f"GatheredParameters(modifier_rank={modifier_rank!r}): the rank whose values are kept must be an int "
                f"in 0..{world - 1} (this world has {world} rank(s)), or None to discard changes"
            )
        if isinstance(params, torch.Tensor):
            params = [params]
        params = list(params) if enabled else []
        # Clients may pass a set (Hugging Face does), whose order differs between ranks; every rank must issue the
        # same collectives in the same order, so zero.Init parameters go in creation order.
        order = {id(p): creation_order(p) for p in params}
        self.params = sorted(params, key=lambda p: -1 if order[id(p)] is None else order[id(p)])
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._flats: list[FlatGroup] = []
        self._keepers: list = []  # per flat group: the object keeping its master weights (overwrite(flat, values))
        self._was_sharded: list[bool] = []
        self._taken: list = []

    def __enter__(self):
        if self.enabled:
            self._agree_on_modifier()
        # before initialize: zero.Init parameters get data for the context, and go back without it at exit
        self._taken = materialize_pending(self.params, get_accelerator().device(comm.backend.local_rank()))
        owners = {}
        for param in self.params:
            records = records_of(param)
            owned = records.flat_of(param) if records is not None else None
            if owned is not None:
                owners[id(owned[0])] = owned
        # rank-independent order (names are unique)
        ordered = sorted(owners.values(), key=lambda owned: owned[0].layout.slots[0].name)
        self._flats = [flat for flat, _ in ordered]
        self._keepers = [keeper for _, keeper in ordered]
        for flat in self._flats:
            self._was_sharded.append(flat.param_state is not ParamState.GATHERED)
            if flat.resident:
                continue
            flat.gather(async_op=False, exact=True)  # ZeRO++ quantizes training's gathers, not these
        return self

    def _agree_on_modifier(self) -> None:
        """Every rank must name the same modifier (or none): ranks that differ would each wait in a broadcast of
        their own. One small all-gather, so each rank can name the others' choice."""
        world = comm.world_group()
        if world.size == 1:
            return
        mine = torch.tensor([-1 if self.modifier_rank is None else self.modifier_rank], dtype=torch.int64)
        everyone = mine.new_empty(world.size)
        comm.all_gather(everyone, mine, world)
        chosen = everyone.tolist()
        if len(set(chosen)) > 1:
            listing = ", ".join(f"rank {r}: {'None' if c < 0 else c}" for r, c in zip(world.ranks, chosen))
            raise ValueError(
                f"GatheredParameters: the ranks pass different modifier_rank ({listing}); every rank must name the "
                "same rank whose values are kept (a literal such as 0, not each rank's own rank), or None on all"
            )

    def __exit__(self, *exc) -> None:
        modified = self.modifier_rank is not None  # whatever the block raised, on this rank or another
        if modified:
            self._keep_modifications()
        for flat, was_sharded in zip(self._flats, self._was_sharded):
            if was_sharded and not flat.resident:
                flat.free()
        put_back(self._taken, self.params if modified else ())  # a written value: each rank keeps its slice

    def _keep_modifications(self) -> None:
        """Every parameter takes the modifier's value among the ranks holding the same value of it (the world for a
        replicated parameter; under tensor or expert parallelism the ranks holding the same piece, from the modifier's
        counterpart among them: never another piece), then each flat group's master weights take the result."""
        world = comm.world_group()
        with torch.no_grad():
            buckets: dict[tuple, list[torch.nn.Parameter]] = {}  # (holders, dtype) -> parameters, in a shared order
            for param in self.params:
                records = records_of(param)
                holders = (records.holders(param) if records is not None else None) or world
                buckets.setdefault((holders.name, holders.ranks, param.dtype), [holders]).append(param)
            for holders, *params in buckets.values():
                _broadcast_values(params, holders.counterpart(self.modifier_rank), holders)
            for flat, keeper in zip(self._flats, self._keepers):
                lo, hi = flat.layout.shard_range(flat.shard_rank)
                if keeper is not None:
                    keeper.overwrite(flat, flat.buffer[lo:hi])
                else:  # parameters without gradients: the compute-precision shard is all there is
                    flat.write_shard(0, flat.buffer[lo:hi].clone())
                    flat.finish_publish()


def _broadcast_values(params: list[torch.nn.Parameter], src: int, group: comm.Group) -> None:
    """Copy the values of ``params`` (one dtype) from global rank ``src`` to every rank of ``group``, in one
    message."""
    if group.size == 1:
        return
    values = [p.data for p in params]
    packed = torch.cat([v.reshape(-1) for v in values]) if len(values) > 1 else values[0].reshape(-1).clone()
    comm.broadcast(packed, src=src, group=group)
    offset = 0
    for value in values:
        value.copy_(packed[offset : offset + value.numel()].view_as(value))
        offset += value.numel()


def consolidated_state_dict(
    module: torch.nn.Module,
    flats: Iterable[FlatGroup],
    rank0_only: bool = True,
    split_groups: Optional[Mapping[str, comm.Group]] = None,
    splits: Optional[dict[str, TensorSplit]] = None,
    expert_names: Optional[Mapping[str, tuple[str, ...]]] = None,
) -> dict:
    """The module's full state dict on CPU, gathering one flat group at a time (never the whole model). Under
    tensor or expert parallelism the pieces of each split parameter (``splits``, by name) are gathered over the
    group of their axis (``split_groups``: ``tp`` -> the tensor group, ``ep`` -> the expert group) and joined; one
    tensor per expert (DeepSpeed's MoE layer) comes out under each expert rank's global name (``expert_names``).
    Every rank of the world must call it."""
    keep = not rank0_only or comm.get_rank() == 0
    splits, expert_names = splits or {}, expert_names or {}
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)

    def whole(param: torch.nn.Parameter) -> dict[str, torch.Tensor]:
        split = next((splits[n] for n in names[id(param)] if n in splits), None)
        value = param.detach()
        group = (split_groups or {}).get(split.axis) if split is not None else None
        if group is not None and group.size > 1:
            pieces = value.new_empty((group.size, *value.shape))
            comm.all_gather(pieces, value.contiguous(), group)
            if split.listed:  # each expert rank's copy is another expert
                globals_ = expert_names[names[id(param)][0]]
                return {globals_[r]: pieces[r].to("cpu", copy=True) for r in range(group.size)} if keep else {}
            value = split.join(list(pieces))
        if not keep:
            return {}
        value = value.to("cpu", copy=True)
        return {name: value for name in names[id(param)]}

    result: dict[str, torch.Tensor] = {}
    handled: set[int] = set()

    def add(param: torch.nn.Parameter) -> None:
        handled.add(id(param))
        result.update(whole(param))

    for flat in flats:
        with GatheredParameters(flat.params):
            for param in flat.params:
                add(param)
    for param in module.parameters():
        if id(param) not in handled:
            add(param)
    if not keep:
        return {}
    for prefix, sub in module.named_modules():
        for name, buffer in sub.named_buffers(recurse=False):
            if buffer is not None and name not in sub._non_persistent_buffers_set:  # as state_dict() decides
                result[f"{prefix}.{name}" if prefix else name] = buffer.detach().to("cpu", copy=True)
    return result
