"""DeepSpeed's ``PipelineParallelGrid`` getters over the mesh: what pipeline clients read off ``engine.grid`` /
``engine.mpu``. Nothing here is a grid of its own: every rank, size and group is the mesh's (``pipe``: the stages of
one copy of the model; ``batch``: DeepSpeed's data-parallel ranks; ``tensor``: its model / slice axis), and the
topology is :func:`~.topology.pipeline_topology` of the mesh's dimensions.

DeepSpeed names two different things "model parallel": ``get_model_parallel_*`` is every rank holding part of one
copy of the model (the stages and their tensor-parallel ranks: the ranks of one data-parallel index, over which it
checks overflow), ``get_slice_parallel_*`` / ``get_tensor_model_parallel_*`` the tensor-parallel ranks of a stage.
"""

from __future__ import annotations

from .. import comm
from .topology import pipeline_topology


class PipelineGrid:
    """DeepSpeed's ``PipelineParallelGrid`` getters over ``mesh`` (see the module; ``model_axis``: the client's
    topology has a ``model`` axis, kept in the view when it is 1). Building it derives the mesh's ``pipe_model``
    group (a collective call: every rank builds its grid)."""

    def __init__(self, mesh: comm.Mesh, model_axis: bool = False):
        self._mesh = mesh
        self._model = mesh.derive("pipe_model")
        self._topo = pipeline_topology(mesh.dims, model_axis)
        self.global_rank = comm.get_rank()
        self.world_size = comm.get_world_size()
        self.pipe_parallel_size, self.data_parallel_size = mesh.pipe.size, mesh.batch.size
        self.model_parallel_size = self.slice_parallel_size = mesh.tensor.size  # the topology's model axis
        self.stage_id = mesh.pipe.rank
        self.data_parallel_id = mesh.batch.rank
        self.is_first_stage = self.stage_id == 0  # attributes, as on DeepSpeed's grid
        self.is_last_stage = self.stage_id == self.pipe_parallel_size - 1
        self.pp_group, self.dp_group = list(mesh.pipe.ranks), list(mesh.batch.ranks)
        self.slice_group = list(mesh.tensor.ranks)

    def get_stage_id(self) -> int:
        return self.stage_id

    def get_data_parallel_id(self) -> int:
        return self.data_parallel_id

    def get_global_rank(self) -> int:
        return self.global_rank

    def topology(self):
        return self._topo

    def stage_to_global(self, stage_id: int, **kwargs) -> int:
        """The rank at pipeline stage ``stage_id`` with this rank's other coordinates (or those ``kwargs`` give:
        ``data=``, a data-parallel rank as ``get_data_parallel_rank`` counts them, over the replica and shard
        dimensions both, the shard one fastest; ``model=``, a tensor-parallel rank)."""
        _check_index("stage_id", stage_id, self.pipe_parallel_size)
        coordinates = {"pp": stage_id}
        if "data" in kwargs:
            data = kwargs.pop("data")
            _check_index("data", data, self.data_parallel_size)
            coordinates["dp_replicate"], coordinates["dp_shard"] = divmod(data, self._mesh.dims.dp_shard)
        if "model" in kwargs and self.slice_parallel_size > 1:
            model = kwargs.pop("model")
            _check_index("model", model, self.slice_parallel_size)
            coordinates["tp"] = model
        if kwargs:
            axes = self._topo.get_axis_names()
            raise ValueError(f"stage_to_global: unknown coordinates {sorted(kwargs)} (this grid has {axes})")
        return self._mesh.dims.rank_at(self.global_rank, **coordinates)

    get_pipe_parallel_rank = get_stage_id

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self):
        return comm.process_group(self._mesh.pipe)

    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size

    def get_data_parallel_group(self):
        return comm.process_group(self._mesh.batch)

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.dp_group

    def get_model_parallel_rank(self) -> int:
        return self._model.rank

    def get_model_parallel_world_size(self) -> int:
        return self._model.size

    def get_model_parallel_group(self):
        return comm.process_group(self._model)

    def get_slice_parallel_rank(self) -> int:
        return self._mesh.tensor.rank

    def get_slice_parallel_world_size(self) -> int:
        return self.slice_parallel_size

    def get_slice_parallel_group(self):
        return comm.process_group(self._mesh.tensor)

    # DeepSpeed's Megatron-style names for the same axes
    get_pipeline_model_parallel_rank = get_stage_id
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size
    get_tensor_model_parallel_rank = get_slice_parallel_rank
    get_tensor_model_parallel_world_size = get_slice_parallel_world_size
    get_tensor_model_parallel_group = get_slice_parallel_group


def _check_index(name: str, value, size: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < size:
        raise ValueError(f"stage_to_global: {name}={value!r} is not an index below {size}")
