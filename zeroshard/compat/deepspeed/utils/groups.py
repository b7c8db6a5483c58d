"""``deepspeed.utils.groups``: the process groups of the newest live engine ``deepspeed.initialize`` built, by
DeepSpeed's getter names. DeepSpeed keeps them per process; zeroshard's belong to an engine (``engine.mesh``), so
these read the newest one (``live_engines``). Tensor-parallel groups are consecutive ranks (``tp_rank = rank % tp``),
data-parallel groups strided (``dp_rank = rank // tp``), as DeepSpeed lays them out. Sequence-parallel groups
(Ulysses) are consecutive ranks; the sequence-data-parallel group (where ZeRO shards and reduces) is the engine's
data group, all ranks without tensor parallelism."""

from __future__ import annotations

from typing import Any

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


def _tensor() -> Group:
    return _mesh().tensor


def _data() -> Group:
    return _mesh().gradient


def get_tensor_model_parallel_group() -> Any:
    return comm.process_group(_tensor())


def get_tensor_model_parallel_world_size() -> int:
    return _tensor().size


def get_tensor_model_parallel_rank() -> int:
    return _tensor().rank


def get_tensor_model_parallel_src_rank() -> int:
    """The global rank of the first rank of this rank's tensor-parallel group."""
    return _tensor().ranks[0]


def get_data_parallel_group() -> Any:
    return comm.process_group(_data())


def get_data_parallel_world_size() -> int:
    return _data().size


def get_data_parallel_rank() -> int:
    return _data().rank


def _get_sequence_parallel_group() -> Any:
    return comm.process_group(_mesh().sequence)


def _get_sequence_parallel_world_size() -> int:
    return _mesh().sequence.size


def _get_sequence_parallel_rank() -> int:
    return _mesh().sequence.rank


def _get_sequence_data_parallel_group() -> Any:
    return comm.process_group(_data())


def _get_sequence_data_parallel_world_size() -> int:
    return _data().size


def _get_sequence_data_parallel_rank() -> int:
    return _data().rank


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


def _expert_groups_not_built(name: str):
    """DeepSpeed's expert-parallel group functions (ArcticTraining's MoE calls them): importable, refused when called,
    since zeroshard has no expert parallelism yet (a parameter tagged ``allreduce = False`` is refused at initialize
    for the same reason)."""

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"deepspeed.utils.groups.{name}: expert parallelism is not implemented by zeroshard yet; train MoE models "
            "with every expert replicated (no expert groups, no parameters tagged allreduce=False)"
        )

    refused.__name__ = refused.__qualname__ = name
    return refused


_create_expert_and_data_parallel = _expert_groups_not_built("_create_expert_and_data_parallel")
_create_expert_data_and_model_parallel = _expert_groups_not_built("_create_expert_data_and_model_parallel")
_get_max_expert_size = _expert_groups_not_built("_get_max_expert_size")
_get_max_expert_size_name = _expert_groups_not_built("_get_max_expert_size_name")
_get_max_expert_parallel_group = _expert_groups_not_built("_get_max_expert_parallel_group")
_get_expert_parallel_group = _expert_groups_not_built("_get_expert_parallel_group")
_get_expert_parallel_group_ranks = _expert_groups_not_built("_get_expert_parallel_group_ranks")
_get_expert_parallel_group_dict = _expert_groups_not_built("_get_expert_parallel_group_dict")
_get_expert_data_parallel_group = _expert_groups_not_built("_get_expert_data_parallel_group")
_get_expert_data_parallel_group_ranks = _expert_groups_not_built("_get_expert_data_parallel_group_ranks")
_get_expert_data_parallel_group_dict = _expert_groups_not_built("_get_expert_data_parallel_group_dict")
_get_expert_broadcast_src_rank = _expert_groups_not_built("_get_expert_broadcast_src_rank")
_get_expert_parallel_world_size = _expert_groups_not_built("_get_expert_parallel_world_size")
_get_expert_data_parallel_world_size = _expert_groups_not_built("_get_expert_data_parallel_world_size")
_get_expert_parallel_rank = _expert_groups_not_built("_get_expert_parallel_rank")
_get_expert_parallel_src_rank = _expert_groups_not_built("_get_expert_parallel_src_rank")
_get_expert_data_parallel_rank = _expert_groups_not_built("_get_expert_data_parallel_rank")
_get_expert_model_parallel_world_size = _expert_groups_not_built("_get_expert_model_parallel_world_size")

__all__ = [
    "_create_expert_and_data_parallel",
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
