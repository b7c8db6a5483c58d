"""``deepspeed.utils.groups``: the process groups of the newest live engine ``deepspeed.initialize`` built, by
DeepSpeed's getter names. DeepSpeed keeps them per process; zeroshard's belong to an engine (``engine.mesh``), so
these read the newest one (``live_engines``). Tensor-parallel groups are consecutive ranks (``tp_rank = rank % tp``),
data-parallel groups strided (``dp_rank = rank // tp``), as DeepSpeed lays them out. Sequence-parallel groups
(Ulysses) are consecutive ranks; the sequence-data-parallel group (where ZeRO shards and reduces) is the engine's
data group, all ranks without tensor parallelism.

Expert groups are the exception: DeepSpeed's protocol creates them before any engine exists
(``_create_expert_and_data_parallel(N)``, by the MoE layer or the client, as ArcticTraining does) and looks them up
by name (``ep_size_<N>``), so this adapter keeps them per process as DeepSpeed does, laid out by
``comm.ParallelDims`` (expert groups of N consecutive ranks, expert-data groups N apart). The engine builds its own
groups of the same layout from the expert parameters' tags."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from zeroshard import comm
from zeroshard.comm import Group

from .live_engines import newest


def _mesh() -> comm.Mesh:
    engine = newest()
    if engine is None:
        raise RuntimeError(
            "deepspeed.utils.groups: no engine built by deepspeed.initialize is alive; the groups exist from "
            "initialize on (tensor parallelism: config tensor_parallel.autotp_size)"
        )
    return engine.mesh


def _handle(group: Group) -> Any:
    """What DeepSpeed's getters return: the torch ``ProcessGroup``, or for a group of this rank alone (which has
    none: zeroshard skips its collectives) the zeroshard group, which ``deepspeed.comm``'s calls take as well."""
    return comm.process_group(group) if group.handle is not None or group.size == comm.get_world_size() else group


def _tensor() -> Group:
    return _mesh().tensor


def _data() -> Group:
    return _mesh().gradient


def get_tensor_model_parallel_group() -> Any:
    return _handle(_tensor())


def get_tensor_model_parallel_world_size() -> int:
    return _tensor().size


def get_tensor_model_parallel_rank() -> int:
    return _tensor().rank


def get_tensor_model_parallel_src_rank() -> int:
    """The global rank of the first rank of this rank's tensor-parallel group."""
    return _tensor().ranks[0]


def get_data_parallel_group() -> Any:
    return _handle(_data())


def get_data_parallel_world_size() -> int:
    return _data().size


def get_data_parallel_rank() -> int:
    return _data().rank


def _get_sequence_parallel_group() -> Any:
    return _handle(_mesh().sequence)


def _get_sequence_parallel_world_size() -> int:
    return _mesh().sequence.size


def _get_sequence_parallel_rank() -> int:
    return _mesh().sequence.rank


def _get_sequence_data_parallel_group() -> Any:
    return _handle(_data())


def _get_sequence_data_parallel_world_size() -> int:
    return _data().size


def _get_sequence_data_parallel_rank() -> int:
    return _data().rank


def _get_broadcast_src_rank() -> int:
    """The global rank the model is broadcast from over the (sequence x) data-parallel group: its first."""
    return _data().ranks[0]


get_sequence_parallel_group = _get_sequence_parallel_group
get_sequence_parallel_world_size = _get_sequence_parallel_world_size
get_sequence_parallel_rank = _get_sequence_parallel_rank
get_sequence_data_parallel_group = _get_sequence_data_parallel_group
get_sequence_data_parallel_world_size = _get_sequence_data_parallel_world_size
get_sequence_data_parallel_rank = _get_sequence_data_parallel_rank

# model parallelism is tensor parallelism here (no pipeline stages), as in DeepSpeed's AutoTP
get_model_parallel_group = get_tensor_model_parallel_group
get_model_parallel_world_size = get_tensor_model_parallel_world_size
get_model_parallel_rank = get_tensor_model_parallel_rank

# the private spellings DeepSpeed's own modules and some clients call
_get_data_parallel_group = get_data_parallel_group
_get_data_parallel_world_size = get_data_parallel_world_size
_get_data_parallel_rank = get_data_parallel_rank
_get_model_parallel_world_size = get_model_parallel_world_size


@dataclass(frozen=True)
class _ExpertGroups:
    expert: Group  # the ranks splitting the experts (DeepSpeed's expert-parallel group)
    expert_data: Group  # the ranks holding the same experts (its expert-data-parallel group)


# DeepSpeed keeps its expert groups per process, by name ("ep_size_<N>"), created before the engine by the MoE layer
# or the client (ArcticTraining); this adapter does as DeepSpeed does. The engine builds its own mesh with the same
# layout from the parameters' tags (``allreduce = False``, ``group_name``).
_EXPERT_GROUPS: dict[str, _ExpertGroups] = {}


def _create_expert_and_data_parallel(
    expert_parallel_size_: int,
    mp_size: Any = None,
    pp_size: Any = None,
    mp_mode: str = "tp",
    use_data_before_expert_parallel_: bool = False,
    folding_spec: Any = None,
) -> None:
    """Expert groups of ``expert_parallel_size_`` consecutive ranks and expert-data groups of the ranks that many
    apart, named ``ep_size_<N>`` (a collective call; a name that exists already is kept, as DeepSpeed does)."""
    extra = {"mp_size": mp_size not in (None, 1), "pp_size": pp_size not in (None, 1), "folding_spec": folding_spec}
    refused = [key for key, given in extra.items() if given]
    if use_data_before_expert_parallel_:
        refused.append("use_data_before_expert_parallel_")
    if refused:
        raise NotImplementedError(
            f"deepspeed.utils.groups._create_expert_and_data_parallel({', '.join(refused)}=...): expert groups with "
            "model or pipeline parallelism, or the data-first layout, are not implemented by zeroshard"
        )
    name = f"ep_size_{expert_parallel_size_}"
    if name in _EXPERT_GROUPS:
        return
    dims = comm.ParallelDims.for_world(comm.get_world_size(), ep=expert_parallel_size_, ep_key="expert_parallel_size_")
    built = comm.build_groups(dims, ("expert", "expert_gradient"), comm.DEFAULT_CONTEXT)
    _EXPERT_GROUPS[name] = _ExpertGroups(built["expert"], built["expert_gradient"])


def _create_expert_data_and_model_parallel(
    expert_parallel_size_: int, mpu: Any, use_data_before_expert_parallel_: bool = False
) -> None:
    """As :func:`_create_expert_and_data_parallel`, for a model-parallel ``mpu`` (ArcticTraining passes None): only
    an mpu without tensor parallelism is taken."""
    if mpu is not None and int(mpu.get_tensor_model_parallel_world_size()) > 1:
        raise NotImplementedError(
            "deepspeed.utils.groups._create_expert_data_and_model_parallel with a tensor-parallel mpu: expert groups "
            "with tensor parallelism are not implemented by zeroshard"
        )
    _create_expert_and_data_parallel(
        expert_parallel_size_, use_data_before_expert_parallel_=use_data_before_expert_parallel_
    )


def _groups(group_name: str) -> _ExpertGroups:
    if group_name not in _EXPERT_GROUPS:
        raise AssertionError(
            f"expert parallel group {group_name!r} is not initialized (groups made: {sorted(_EXPERT_GROUPS)}); call "
            "deepspeed.utils.groups._create_expert_and_data_parallel(N) first"
        )
    return _EXPERT_GROUPS[group_name]


def _get_expert_parallel_group(group_name: str) -> Any:
    return comm.process_group(_groups(group_name).expert)


def _get_expert_parallel_group_ranks(group_name: str) -> list[int]:
    return list(_groups(group_name).expert.ranks)


def _get_expert_parallel_group_dict() -> dict[str, Any]:
    return {name: comm.process_group(g.expert) for name, g in _EXPERT_GROUPS.items()}


def _get_expert_data_parallel_group(group_name: str) -> Any:
    return comm.process_group(_groups(group_name).expert_data)


def _get_expert_data_parallel_group_ranks(group_name: str) -> list[int]:
    return list(_groups(group_name).expert_data.ranks)


def _get_expert_data_parallel_group_dict() -> dict[str, Any]:
    return {name: comm.process_group(g.expert_data) for name, g in _EXPERT_GROUPS.items()}


def _get_expert_parallel_world_size(group_name: str) -> int:
    return _groups(group_name).expert.size


def _get_expert_parallel_rank(group_name: str) -> int:
    return _groups(group_name).expert.rank


def _get_expert_parallel_src_rank(group_name: str) -> int:
    """The global rank of the first rank of this rank's expert group."""
    return _groups(group_name).expert.ranks[0]


def _get_expert_data_parallel_world_size(group_name: str) -> int:
    return _groups(group_name).expert_data.size


def _get_expert_data_parallel_rank(group_name: str) -> int:
    return _groups(group_name).expert_data.rank


def _get_expert_broadcast_src_rank(group_name: str) -> int:
    """The global rank of the first rank of this rank's expert-data group (where expert weights start from)."""
    return _groups(group_name).expert_data.ranks[0]


def _get_max_expert_size() -> Optional[int]:
    sizes = [g.expert.size for g in _EXPERT_GROUPS.values()]
    return max(sizes) if sizes else None


def _get_max_expert_size_name() -> str:
    return f"ep_size_{_get_max_expert_size()}"


def _get_max_expert_parallel_group() -> Any:
    return _get_expert_parallel_group(_get_max_expert_size_name())


def _get_expert_model_parallel_world_size() -> int:
    """Tensor parallelism inside experts: never here."""
    return 1


__all__ = [
    "_create_expert_and_data_parallel",
    "_get_broadcast_src_rank",
    "_create_expert_data_and_model_parallel",
    "_get_max_expert_size",
    "_get_max_expert_size_name",
    "_get_max_expert_parallel_group",
    "_get_expert_parallel_group",
    "_get_expert_parallel_group_ranks",
    "_get_expert_parallel_group_dict",
    "_get_expert_data_parallel_group",
    "_get_expert_data_parallel_group_ranks",
    "_get_expert_data_parallel_group_dict",
    "_get_expert_broadcast_src_rank",
    "_get_expert_parallel_world_size",
    "_get_expert_data_parallel_world_size",
    "_get_expert_parallel_rank",
    "_get_expert_parallel_src_rank",
    "_get_expert_data_parallel_rank",
    "_get_expert_model_parallel_world_size",
    "_get_sequence_data_parallel_group",
    "_get_sequence_data_parallel_rank",
    "_get_sequence_data_parallel_world_size",
    "_get_sequence_parallel_group",
    "_get_sequence_parallel_rank",
    "_get_sequence_parallel_world_size",
    "get_sequence_data_parallel_group",
    "get_sequence_data_parallel_rank",
    "get_sequence_data_parallel_world_size",
    "get_sequence_parallel_group",
    "get_sequence_parallel_rank",
    "get_sequence_parallel_world_size",
    "get_data_parallel_group",
    "get_data_parallel_rank",
    "get_data_parallel_world_size",
    "get_model_parallel_group",
    "get_model_parallel_rank",
    "get_model_parallel_world_size",
    "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_src_rank",
    "get_tensor_model_parallel_world_size",
]
