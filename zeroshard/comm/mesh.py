"""The mesh: how a run's ranks split over named parallel dimensions, and the process groups derived from it.

:class:`ParallelDims` (pure, torchtitan's name) holds one size per dimension and lays the world out as
``arange(world).view(pp, dp_replicate, dp_shard, sp, tp)``: the tensor-parallel dimension is innermost (consecutive
ranks, ``tp_rank = rank % tp``, as DeepSpeed lays out AutoTP), sequence parallelism next, then the two data-parallel
dimensions. A group is the ranks that differ only along some dimensions; every group the engine uses is one such
set of dimensions, named once here (:data:`DERIVED`):

- ``tensor`` (tp): the ranks that split a layer's matrices;
- ``sequence`` (sp): the ranks that split each sample's tokens (Ulysses);
- ``shard`` (dp_shard x sp): ZeRO's shard group, the ranks that split parameters, gradients and optimizer state.
  Sequence ranks hold the same model and see different tokens, so ZeRO shards over them too (DeepSpeed's
  "sequence data parallel" group);
- ``replica`` (dp_replicate): the ranks holding the same shard (hybrid sharding: ``zero_hpz_partition_size``,
  ``mics_shard_size``);
- ``batch`` (dp_replicate x dp_shard): the ranks that see different samples; the batch arithmetic counts these
  (``train_batch_size = micro x accumulation x batch``);
- ``gradient`` (dp_replicate x dp_shard x sp): every rank whose gradients sum into one update (all but tensor).

Expert parallelism splits the sharded data dimension: ``dp_shard`` ranks are ``edp`` groups of ``ep`` consecutive
data ranks (DeepSpeed's layout: expert groups of consecutive ranks, expert-data groups ``ep`` apart). The ``ep``
ranks of one expert group hold different experts and exchange tokens; they still see different samples, so
``batch`` and ``shard`` keep every data rank. It composes with every other dimension: sequence ranks route their own
tokens; hybrid sharding's replicas each hold the expert groups. With tensor parallelism the expert group takes in
``ep_in_tp`` ranks of each tensor group (AutoEP folds the tensor dimension into the expert one, as DeepSpeed 0.19
lays it out: an expert group is ``ep`` consecutive ranks, ``min(ep, tp)`` of them tensor ranks). The tensor ranks
hold the same tokens after the row-parallel all-reduce, so each routes its own slice of them and the experts'
outputs are gathered back over the tensor group: no tensor rank repeats another's expert work. Expert parameters
models declare (DeepSpeed's MoE layer, tagged tensors) are computed by the client's code on every token a rank
holds: there ``ep_in_tp`` is 1 and the ranks of a tensor group hold the same experts whole. The mesh dimensions
are ``ep_data`` (expert ranks along the data dimension) and ``ep_tensor`` (along the tensor one): ``ep`` is
``ep_data x ep_tensor``, ``dp_shard`` is ``edp x ep_data``, ``tp`` is ``tp_rest x ep_tensor``. The groups of expert
parameters:

- ``expert`` (ep): the ranks that split the experts between them and exchange tokens;
- ``expert_shard`` (edp x sp, and tp_rest when folded): ZeRO's shard group of expert parameters, the ranks holding
  the same experts and routing different tokens;
- ``expert_gradient`` (dp_replicate x ``expert_shard``): every rank whose expert gradients sum into one update (the
  sum is divided by the whole data-parallel size, as dense gradients are, so an expert's update does not depend on
  ``ep``).

Pipeline parallelism (``pp``) is outermost: each of its ``pp`` blocks of consecutive ranks runs one stage of the
model (DeepSpeed's ``PipeDataParallelTopology`` lays ranks out the same way), and every group above lies inside one
stage. Two more groups:

- ``pipe`` (pp): the ranks holding the successive stages of one copy of the model (they exchange activations and
  gradients, and complete the gradient norm);
- ``stage`` (everything but pp): the ranks holding one stage, each one part of it (the whole world without
  pipelining): the ranks that start with the same weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from .backend import get_rank, get_world_size
from .context import DEFAULT_CONTEXT, CommContext
from .groups import Group, new_process_group

ORDER = ("pp", "dp_replicate", "edp", "ep_data", "sp", "tp_rest", "ep_tensor")  # outermost to innermost
COMPOSITE = {"dp_shard": ("edp", "ep_data"), "ep": ("ep_data", "ep_tensor"), "tp": ("tp_rest", "ep_tensor")}
DERIVED = {
    "tensor": ("tp",),
    "sequence": ("sp",),
    "shard": ("dp_shard", "sp"),
    "replica": ("dp_replicate",),
    "batch": ("dp_replicate", "dp_shard"),
    "gradient": ("dp_replicate", "dp_shard", "sp"),
    "expert": ("ep",),
    "expert_shard": ("edp", "sp"),
    "expert_gradient": ("dp_replicate", "edp", "sp"),
    "pipe": ("pp",),
    "stage": ("dp_replicate", "dp_shard", "sp", "tp"),
    "pipe_model": ("pp", "sp", "tp"),  # built on demand (Mesh.derive): DeepSpeed's pipeline grid's model group
}
ON_DEMAND = ("pipe_model",)  # derived names only some engines use: built by Mesh.derive, not by build_mesh
ROUTING_DIFFERENT_TOKENS = ("expert_shard", "expert_gradient")  # take in tp_rest when the expert group spans tp


@dataclass(frozen=True)
class ParallelDims:
    """The size of every parallel dimension; their product (``ep`` inside ``dp_shard``) is the world. Pure: every
    rule about which ranks group together lives here and is testable without processes."""

    dp_replicate: int = 1
    dp_shard: int = 1
    sp: int = 1
    tp: int = 1
    ep: int = 1
    pp: int = 1
    ep_in_tp: int = 1  # tensor ranks in each expert group (1: the tensor ranks hold the same experts)

    def __post_init__(self):
        for name in ("dp_replicate", "dp_shard", "sp", "tp", "ep", "pp", "ep_in_tp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"parallel dimension {name} must be a positive int, got {value!r}")
        if self.ep % self.ep_in_tp or self.tp % self.ep_in_tp:
            raise ValueError(f"ep_in_tp={self.ep_in_tp} must divide both ep={self.ep} and tp={self.tp}")
        if self.dp_shard % self.ep_data:
            raise ValueError(
                f"expert parallelism ep={self.ep} over {self.ep_in_tp} tensor rank(s) must divide the sharded "
                f"data-parallel size dp_shard={self.dp_shard}: expert groups are made of data-parallel ranks"
            )

    def splits_over_tensor(self, axis: Optional[str]) -> bool:
        """Whether pieces along split axis ``axis`` (``TensorSplit.axis``; None: replicated) differ between the ranks
        of a tensor group: tensor-parallel pieces do, experts when the expert group takes in tensor ranks."""
        return axis == "tp" or (axis == "ep" and self.ep_in_tp > 1)

    @property
    def ep_data(self) -> int:
        """The data-parallel ranks of one expert group."""
        return self.ep // self.ep_in_tp

    @property
    def edp(self) -> int:
        """The expert-data-parallel part of ``dp_shard``: how many expert groups a shard group holds."""
        return self.dp_shard // self.ep_data

    @classmethod
    def for_world(
        cls,
        world_size: int,
        *,
        tp: int = 1,
        sp: int = 1,
        shard_group_size: Optional[int] = None,
        ep: int = 1,
        experts_span_tensor: bool = False,
        pp: int = 1,
        tp_key: str = "tensor_parallel.autotp_size",
        ep_key: str = "expert_parallel.autoep_size",
    ) -> ParallelDims:
        """The dimensions of ``world_size`` ranks from the config's sizes (``tensor_parallel.autotp_size``,
        ``sequence_parallel_size``, and ZeRO's shard group size, ``zero_hpz_partition_size`` / ``mics_shard_size``:
        the data x sequence ranks otherwise) and the expert-parallel size (``ep_key``: what set it).
        ``experts_span_tensor``: zeroshard routes the experts (AutoEP), so an expert group takes in ``min(ep, tp)``
        tensor ranks. Each mismatch is an error naming its key (``tp_key``: inference's
        ``tensor_parallel.tp_size``). ``pp`` pipeline stages each take ``world_size / pp`` consecutive ranks; the
        other sizes are of one stage's ranks."""
        world_size = _ranks_per_stage(world_size, pp)
        for key, size in ((tp_key, tp), ("sequence_parallel_size", sp)):
            if isinstance(size, bool) or not isinstance(size, int) or size < 1 or world_size % size:
                raise ValueError(
                    f"{key} {size} must divide the number of ranks {world_size}: launch with a multiple of {size} "
                    f"processes (e.g. zeroshard --num_gpus {size} ...)"
                )
        if world_size % (tp * sp):
            raise ValueError(
                f"tensor_parallel.autotp_size {tp} x sequence_parallel_size {sp} must divide the number of ranks "
                f"{world_size}: launch with a multiple of {tp * sp} processes"
            )
        data_and_sequence = world_size // tp
        shard = shard_group_size or data_and_sequence
        if shard < 1 or data_and_sequence % shard:
            raise ValueError(
                f"shard group size {shard} must divide the world size {data_and_sequence} "
                "(zero_hpz_partition_size / mics_shard_size; the ranks of one tensor-parallel position)"
            )
        if shard % sp:
            raise ValueError(
                f"shard group size {shard} (zero_hpz_partition_size / mics_shard_size) must be a multiple of "
                f"sequence_parallel_size {sp}: ZeRO shards over whole sequence-parallel groups"
            )
        valid_ep = not isinstance(ep, bool) and isinstance(ep, int) and ep >= 1
        ep_in_tp = _tensor_ranks_per_expert_group(ep, tp, ep_key) if valid_ep and experts_span_tensor else 1
        if not valid_ep or (shard // sp) % (ep // ep_in_tp):
            spanned = f" (its {ep // ep_in_tp} data-parallel x {ep_in_tp} tensor ranks)" if ep_in_tp > 1 else ""
            needed = (ep // ep_in_tp if valid_ep else 1) * sp * tp  # each data-parallel rank brings sp x tp ranks
            fix = (
                "raise zero_hpz_partition_size / mics_shard_size"
                if shard_group_size
                else f"launch a multiple of {needed} processes ({needed // (sp * tp)} data-parallel x {sp} "
                f"sequence-parallel x {tp} tensor-parallel ranks)"
            )
            raise ValueError(
                f"{ep_key} {ep}{spanned} must divide the {shard // sp} data-parallel ranks of a shard group "
                f"({world_size} ranks launched): expert groups are made of data-parallel ranks; {fix}"
            )
        data_replicas = data_and_sequence // shard
        return cls(dp_replicate=data_replicas, dp_shard=shard // sp, sp=sp, tp=tp, ep=ep, pp=pp, ep_in_tp=ep_in_tp)

    @property
    def world_size(self) -> int:
        return math.prod(self._size(name) for name in ORDER)

    def _size(self, name: str) -> int:
        parts = {"ep_tensor": self.ep_in_tp, "tp_rest": self.tp // self.ep_in_tp}
        return parts[name] if name in parts else getattr(self, name)

    @staticmethod
    def _expand(dims) -> set[str]:
        """``dims`` in the mesh's own dimensions (``dp_shard`` is ``edp`` x ``ep``)."""
        unknown = set(dims) - set(ORDER) - set(COMPOSITE)
        if unknown:
            raise ValueError(f"unknown parallel dimension(s) {sorted(unknown)}; the mesh has {list(ORDER)}")
        return {part for name in dims for part in COMPOSITE.get(name, (name,))}

    @property
    def data_parallel_size(self) -> int:
        """Ranks that see different samples (DeepSpeed's ``dp_world_size``: the world over tp x sp)."""
        return self.dp_replicate * self.dp_shard

    def groups(self, dims: tuple[str, ...]) -> list[list[int]]:
        """The world cut into groups of the ranks that differ only along ``dims`` (each list one group, its ranks in
        order). Every rank is in exactly one group."""
        dims = self._expand(dims)
        shape = [self._size(name) for name in ORDER]
        grid = torch.arange(self.world_size).view(shape)
        inner = [ORDER.index(name) for name in ORDER if name in dims]
        outer = [i for i in range(len(ORDER)) if i not in inner]
        size = math.prod(shape[i] for i in inner)
        return grid.permute(outer + inner).reshape(-1, size).tolist()

    def _parts(self, name: str, value: int) -> dict[str, int]:
        """A coordinate on ``name`` as coordinates on the mesh's own dimensions (a composite's inner part varies
        fastest)."""
        size = math.prod(self._size(part) for part in COMPOSITE.get(name, (name,)))
        if not 0 <= value < size:
            raise ValueError(f"coordinate {name}={value} is outside the mesh {self}")
        parts = {}
        for part in reversed(COMPOSITE.get(name, (name,))):
            value, parts[part] = divmod(value, self._size(part))
        return parts

    def coordinate(self, rank: int, name: str) -> int:
        """``rank``'s index along ``name`` (a composite's: its parts' indices, the inner part fastest), e.g. which
        expert rank of its expert group ``rank`` is: ``coordinate(rank, "ep")``."""
        self._expand((name,))
        index = 0
        for part in COMPOSITE.get(name, (name,)):
            inner = math.prod(self._size(n) for n in ORDER[ORDER.index(part) + 1 :])
            index = index * self._size(part) + rank // inner % self._size(part)
        return index

    def rank_at(self, rank: int, **coordinates: int) -> int:
        """The rank whose coordinates are ``rank``'s with ``coordinates`` (dimension -> index) put in, e.g. the
        rank holding tensor-parallel piece 1 of what ``rank`` holds piece 0 of: ``rank_at(rank, tp=1)``."""
        self._expand(coordinates)
        own = {part: v for name, value in coordinates.items() for part, v in self._parts(name, value).items()}
        moved, stride = rank, 1
        for name in reversed(ORDER):  # innermost first: a dimension's index is (rank // stride) % size
            size = self._size(name)
            if name in own:
                moved += (own[name] - (rank // stride) % size) * stride
            stride *= size
        return moved

    def derived(self, name: str) -> list[list[int]]:
        """The groups of one derived name (:data:`DERIVED`). When the expert group spans tensor ranks, each tensor
        rank routes its own slice of the tokens, so the tensor ranks holding the same experts (``tp_rest``) add up
        their expert gradients and share the experts' shards."""
        spans = self.ep_in_tp > 1 and name in ROUTING_DIFFERENT_TOKENS
        return self.groups(DERIVED[name] + (("tp_rest",) if spans else ()))


def _ranks_per_stage(world_size: int, pp: int) -> int:
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1 or world_size % pp:
        raise ValueError(
            f"pipeline stages {pp} must divide the number of ranks {world_size} (DeepSpeed's num_stages / "
            f"pipeline.stages): launch a multiple of {pp} processes"
        )
    return world_size // pp


def _tensor_ranks_per_expert_group(ep: int, tp: int, ep_key: str) -> int:
    """How many tensor ranks an expert group of ``ep`` consecutive ranks takes in: all ``tp`` (``ep`` a multiple of
    ``tp``) or ``ep`` of them (``ep`` dividing ``tp``); other sizes would cut tensor groups across expert groups."""
    if ep % tp and tp % ep:
        raise ValueError(
            f"{ep_key} {ep} with tensor_parallel.autotp_size {tp}: an expert group of {ep} consecutive ranks must "
            f"hold whole tensor groups or lie inside one (one size a multiple of the other)"
        )
    return min(ep, tp)


@dataclass(frozen=True)
class Mesh:
    """This rank's group on every derived dimension (:data:`DERIVED`), built by :func:`build_mesh`."""

    dims: ParallelDims
    world: Group
    tensor: Group
    sequence: Group
    shard: Group
    replica: Group
    batch: Group
    gradient: Group
    expert: Group
    expert_shard: Group
    expert_gradient: Group
    pipe: Group
    stage: Group
    registered: bool = False  # built by register_with_transformers for the engines run on it: none tears it down
    # the registered mesh this one refines (more dimensions than the registration knew): its process groups of the
    # same ranks are used here, and stay when this mesh goes
    base: Optional["Mesh"] = field(default=None, compare=False, repr=False)
    # groups built after the mesh by :meth:`derive` (a pipeline's tie groups, its stage channel), by name; released
    # with the mesh
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def data_parallel_size(self) -> int:
        return self.batch.size

    @property
    def pieces(self) -> dict[str, Group]:
        """The group along each split axis (``TensorSplit.axis``): the ranks holding the other pieces of a tensor-
        parallel matrix (``tp``) or the other experts of an expert-parallel tensor (``ep``)."""
        return {"tp": self.tensor, "ep": self.expert}

    @property
    def piece_holders(self) -> dict[str, Group]:
        """The ranks holding the same piece along each split axis (the replicas of a piece): under tensor
        parallelism the gradient group, under expert parallelism the expert-gradient group."""
        return {"tp": self.gradient, "ep": self.expert_gradient}

    @property
    def context(self) -> CommContext:
        """Where the mesh's collectives are counted (one context for all its groups)."""
        return self.world.context

    def derive(self, name: str, partition: Optional[list[list[int]]] = None) -> Optional[Group]:
        """This rank's group of ``partition`` (disjoint lists of ranks; by default the on-demand derived
        dimensions of ``name``, :data:`ON_DEMAND`), built now with process groups of its own (a collective call:
        every rank makes the same calls in the same order) and kept under ``name`` until :func:`destroy_mesh`
        releases it with the others. None when no part holds this rank. Deriving a name again returns its group.

        A pipeline derives the groups of the stages sharing a tied module and a channel of its own for the
        activations (``pipe``'s ranks, apart, so nothing a failed batch left unreceived reaches another group)."""
        if name in self.extra:
            return self.extra[name]
        if partition is None:
            if name not in ON_DEMAND:
                raise ValueError(f"mesh.derive({name!r}) needs partition=: only {list(ON_DEMAND)} are derived by name")
            partition = self.dims.derived(name)
        parts = tuple(tuple(part) for part in partition)
        members = [rank for part in parts for rank in part]
        if len(set(members)) != len(members) or not all(0 <= r < self.world.size for r in members):
            raise ValueError(f"mesh.derive({name!r}): the parts {partition} are not disjoint ranks of the world")
        handles = [new_process_group(list(part)) if len(part) > 1 else None for part in parts]
        mine = next((k for k, part in enumerate(parts) if get_rank() in part), None)
        group = None if mine is None else Group(name, parts[mine], handles[mine], self.context, partition=parts)
        self.extra[name] = group
        return group


def build_groups(
    dims: ParallelDims, names: tuple[str, ...], context: CommContext, built: Optional[dict] = None
) -> dict[str, Group]:
    """This rank's group of each derived name in ``names`` (a collective call: every rank makes the same calls in
    the same order), one process group per distinct partition of the world: two names with the same ranks share
    it. A group of the whole world uses the default group; a group of one rank needs none (its collectives are
    skipped). ``built``: partitions whose process groups exist already (partition -> this rank's handle)."""
    world_size, rank = get_world_size(), get_rank()
    handles: dict[tuple, Any] = dict(built or {})
    groups = {}
    for name in names:
        key = tuple(map(tuple, dims.derived(name)))
        part = next(p for p in key if rank in p)
        if key not in handles:
            made = {p: new_process_group(list(p)) if 1 < len(p) < world_size else None for p in key}
            handles[key] = made[part]
        groups[name] = Group(name, part, handles[key], context, partition=key)
    return groups


def build_mesh(
    dims: ParallelDims,
    context: Optional[CommContext] = None,
    base: Optional[Mesh] = None,
    registered: bool = False,
) -> Mesh:
    """Create the mesh's groups (a collective call). Their collectives count in ``context`` (by default a new child
    of the process's default context). ``base``: the mesh ``register_with_transformers`` built, which this one
    refines with what the config adds (hybrid sharding, experts, pipeline stages): a dimension with the same ranks
    as one of the base's is the base's group (its process group, its ledger), so attention and the engine share one
    set of groups. ``registered``: built by ``register_with_transformers``, outliving the engines run on it."""
    world_size = get_world_size()
    if dims.world_size != world_size:
        raise ValueError(f"the parallel dimensions {dims} cover {dims.world_size} ranks, the world has {world_size}")
    if base is not None:
        context = base.context
    context = context or DEFAULT_CONTEXT.child()
    built = {g.partition: g.handle for g in _groups(base) if g.partition} if base is not None else {}
    groups = build_groups(dims, tuple(name for name in DERIVED if name not in ON_DEMAND), context, built)
    world = Group("world", tuple(range(world_size)), None, context)
    for name in ("gradient", "expert_gradient", "stage"):
        if groups[name].size == world_size:  # without tensor (expert, pipeline) parallelism it is the world
            groups[name] = world
    return Mesh(dims=dims, world=world, registered=registered, base=base, **groups)


def _groups(mesh: Mesh) -> list[Group]:
    """Every group of ``mesh``: its dimensions' and those derived after it."""
    named = [getattr(mesh, name) for name in DERIVED if name not in ON_DEMAND]
    return [*named, *(g for g in mesh.extra.values() if g is not None)]


def planned_group(name: str, size: int) -> Group:
    """A group of ``size`` ranks with this process first, without a process group: a description for planning on a
    meta model (``zeroshard estimate``), which reads its size and never communicates over it."""
    me = get_rank()
    return Group(name, (me, *[r for r in range(me + size) if r != me][: size - 1]), None)


def destroy_mesh(mesh: Mesh) -> None:
    """Tear down the process groups :func:`build_mesh` and :meth:`Mesh.derive` created (the default group and its
    base's groups stay: they are not the mesh's; a registered mesh stays whole)."""
    if not dist.is_initialized() or mesh.registered:
        return
    kept = {id(g.handle) for g in _groups(mesh.base)} if mesh.base is not None else set()
    handles = {id(g.handle): g.handle for g in _groups(mesh) if g.handle is not None and id(g.handle) not in kept}
    mesh.extra.clear()
    for handle in handles.values():
        dist.destroy_process_group(handle)


def tensor_parallel_group(tp_size: int) -> Group:
    """This rank's tensor-parallel group of ``tp_size`` consecutive ranks, and no other group (a collective call;
    inference and ``tp_model_init``)."""
    dims = ParallelDims.for_world(get_world_size(), tp=tp_size, tp_key="tensor_parallel.tp_size")
    return build_groups(dims, ("tensor",), DEFAULT_CONTEXT)["tensor"]
