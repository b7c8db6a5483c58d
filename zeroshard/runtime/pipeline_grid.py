"""DeepSpeed's ``PipelineParallelGrid`` getters over the mesh: what pipeline clients read off ``engine.grid`` /
``engine.mpu`` (ranks, sizes and process groups of the pipe and data dimensions; model parallelism: this rank
alone)."""

from __future__ import annotations

from .. import comm


class PipelineGrid:
    """DeepSpeed's ``PipelineParallelGrid`` getters over the mesh (``engine.grid``, ``engine.mpu``): ranks, sizes and
    process groups of the pipe and data dimensions (model parallelism: this rank alone)."""

    def __init__(self, mesh: comm.Mesh, topology):
        self._mesh, self._topo = mesh, topology
        self.global_rank = comm.get_rank()
        self.world_size = comm.get_world_size()
        self.pipe_parallel_size, self.data_parallel_size, self.model_parallel_size = mesh.pipe.size, mesh.batch.size, 1
        self.slice_parallel_size = 1
        self.stage_id = mesh.pipe.rank
        self.data_parallel_id = mesh.batch.rank
        self.pp_group, self.dp_group = list(mesh.pipe.ranks), list(mesh.batch.ranks)

    def get_stage_id(self) -> int:
        return self.stage_id

    def get_global_rank(self) -> int:
        return self.global_rank

    def topology(self):
        return self._topo

    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.pipe_parallel_size - 1

    def stage_to_global(self, stage_id: int, **kwargs) -> int:
        """The rank at pipeline stage ``stage_id`` with this rank's other coordinates (or those ``kwargs`` give:
        ``data=``, a data-parallel rank as ``get_data_parallel_rank`` counts them: over the replica and shard
        dimensions both, the shard one fastest)."""
        _check_index("stage_id", stage_id, self.pipe_parallel_size)
        coordinates = {"pp": stage_id}
        if "data" in kwargs:
            data = kwargs.pop("data")
            _check_index("data", data, self.data_parallel_size)
            coordinates["dp_replicate"], coordinates["dp_shard"] = divmod(data, self._mesh.dims.dp_shard)
        if kwargs:
            raise ValueError(f"stage_to_global: unknown coordinates {sorted(kwargs)} (this grid has pipe and data)")
        return self._mesh.dims.rank_at(self.global_rank, **coordinates)

    def get_pipe_parallel_rank(self) -> int:
        return self.stage_id

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

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_slice_parallel_rank(self) -> int:
        return 0

    def get_slice_parallel_world_size(self) -> int:
        return 1


def _check_index(name: str, value, size: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < size:
        raise ValueError(f"stage_to_global: {name}={value!r} is not an index below {size}")
