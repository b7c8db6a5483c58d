"""DeepSpeed's process topologies (``deepspeed.runtime.pipe.topology``), pure: a rank grid over named axes, and the
mesh dimensions a pipeline topology is (:func:`parallel_dims`) and back (:func:`pipeline_topology`).

Clients of DeepSpeed's pipeline engine build these by hand (gpt-neox builds ``PipeModelDataParallelTopology`` and
reads ``get_coord``, ``get_axis_comm_lists`` and ``filter_match`` off it), so the names, the axis order and the
numbering are DeepSpeed's: ranks are laid out row-major over ``axes``, the last axis varying fastest. A pipeline
topology puts ``pipe`` outermost, as zeroshard's mesh puts ``pp`` (:class:`zeroshard.comm.ParallelDims`), so the
ranks of one stage are consecutive.
"""

from __future__ import annotations

import math
from collections import namedtuple
from typing import Sequence

import torch

from ..comm import ParallelDims


class ProcessTopology:
    """Ranks ``0 .. prod(dims) - 1`` on a grid of ``axes`` (names) of sizes ``dims``, row-major."""

    def __init__(self, axes: Sequence[str], dims: Sequence[int]):
        axes, dims = list(axes), list(dims)
        if not axes or len(axes) != len(dims) or len(set(axes)) != len(axes):
            raise ValueError(f"a topology needs distinct axis names, one size each: axes {axes}, dims {dims}")
        if not all(isinstance(a, str) and a.isidentifier() for a in axes):
            raise ValueError(f"topology axis names must be identifiers, got {axes}")
        if any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in dims):
            raise ValueError(f"topology axis sizes must be positive ints, got {dims}")
        self.axes, self.dims = axes, dims
        self.ProcessCoord = namedtuple("ProcessCoord", axes)
        self._grid = torch.arange(math.prod(dims)).view(dims)

    def world_size(self) -> int:
        return self._grid.numel()

    def get_axis_names(self) -> list[str]:
        return self.axes

    def get_dim(self, axis: str) -> int:
        """The size of ``axis`` (0 when the topology has no such axis, as DeepSpeed answers)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_rank(self, **coordinates: int) -> int:
        """The rank at ``coordinates`` (every axis named)."""
        if set(coordinates) != set(self.axes):
            raise ValueError(f"get_rank needs a coordinate on every axis {self.axes}, got {sorted(coordinates)}")
        index = []
        for axis, size in zip(self.axes, self.dims):
            value = coordinates[axis]
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < size:
                raise ValueError(f"coordinate {axis}={value!r} is outside the topology's {size} positions")
            index.append(value)
        return int(self._grid[tuple(index)])

    def get_coord(self, rank: int):
        """``rank``'s coordinates, a ``ProcessCoord`` named tuple (``coord.pipe``, ``coord.data``, ...)."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size():
            raise ValueError(f"rank {rank!r} not found in topology of {self.world_size()} ranks")
        return self.ProcessCoord(*(int(i) for i in torch.unravel_index(torch.tensor(rank), self.dims)))

    def get_rank_repr(self, rank: int, omit_axes=("data", "pipe"), inner_sep: str = "_", outer_sep: str = "-") -> str:
        """``rank``'s coordinates on the axes not omitted, as DeepSpeed names checkpoint files by them
        (``model_01``)."""
        coord = self.get_coord(rank)
        kept = [axis for axis in self.axes if axis not in frozenset(omit_axes)]
        return outer_sep.join(f"{axis}{inner_sep}{getattr(coord, axis):02d}" for axis in kept)

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """The groups of ranks that differ only along ``axis`` (one per position on the other axes, in order);
        [] when the topology has no such axis."""
        if axis not in self.axes:
            return []
        at = self.axes.index(axis)
        others = [i for i in range(len(self.axes)) if i != at]
        return self._grid.permute(others + [at]).reshape(-1, self.dims[at]).tolist()

    def filter_match(self, **criteria: int) -> list[int]:
        """The ranks whose coordinates equal ``criteria`` on the axes named, in rank order."""
        unknown = set(criteria) - set(self.axes)
        if unknown:
            raise ValueError(f"filter_match on unknown axes {sorted(unknown)}; the topology has {self.axes}")
        index = tuple(criteria.get(axis, slice(None)) for axis in self.axes)
        return sorted(self._grid[index].reshape(-1).tolist())

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """The ranks at position ``idx`` of ``axis``, in rank order."""
        return self.filter_match(**{axis: idx})

    def __repr__(self) -> str:
        return f"{type(self).__name__}(axes={self.axes}, dims={self.dims})"


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline stages outermost, data-parallel ranks inside each stage."""

    def __init__(self, num_pp: int, num_dp: int):
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline, data and (innermost) model-parallel ranks: a stage's tensor-parallel ranks are consecutive."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int):
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


MESH_AXES = {"pipe": "pp", "data": "dp_shard", "sequence": "sp", "model": "tp"}  # a pipeline topology's axes, meshed


def parallel_dims(topology: ProcessTopology) -> ParallelDims:
    """The mesh a pipeline topology describes: ``pipe`` stages, ``data``-, ``sequence``- and ``model`` (tensor-)
    parallel ranks as the mesh's ``pp``, ``dp_shard``, ``sp`` and ``tp``. Its numbering must be the mesh's (``pipe``
    outermost, ``model`` innermost, as ``PipeDataParallelTopology`` and gpt-neox's ``PipeModelDataParallelTopology``
    lay ranks out), so the topology is a view of the mesh and not a second grid."""
    unknown = [axis for axis in topology.get_axis_names() if axis not in MESH_AXES]
    if unknown or "pipe" not in topology.get_axis_names():
        raise ValueError(
            f"topology axes {topology.get_axis_names()}: a pipeline topology has a 'pipe' axis and may have 'data', "
            f"'sequence' and 'model' ones; {unknown or ['no pipe axis']} has no place on the mesh"
        )
    sizes = {MESH_AXES[axis]: topology.get_dim(axis) for axis in topology.get_axis_names()}
    dims = ParallelDims(**sizes)
    for rank in range(topology.world_size()):
        coord = topology.get_coord(rank)
        if any(getattr(coord, axis) != dims.coordinate(rank, MESH_AXES[axis]) for axis in topology.get_axis_names()):
            raise ValueError(
                f"topology axes {topology.get_axis_names()}: rank {rank} is at {coord} there but elsewhere on the "
                "mesh; the pipeline axis must be outermost and the model axis innermost (each stage consecutive "
                "ranks, its tensor-parallel ranks consecutive, as PipeDataParallelTopology and "
                "PipeModelDataParallelTopology lay them out)"
            )
    return dims


def pipeline_topology(dims: ParallelDims, model_axis: bool = False) -> ProcessTopology:
    """The pipeline topology DeepSpeed's clients read off the engine (``engine.grid.topology()``) for a mesh of
    pipeline, data-, sequence- and tensor-parallel ranks: ``PipeModelDataParallelTopology`` with tensor parallelism
    (or ``model_axis``: the client built one, of size 1), else ``PipeDataParallelTopology``; with sequence
    parallelism (DeepSpeed's topologies have no such axis) a ``ProcessTopology`` of the same axes and a ``sequence``
    axis between ``data`` and ``model``, as the mesh orders them."""
    data = dims.dp_replicate * dims.dp_shard
    if dims.sp > 1:
        model = [("model", dims.tp)] if dims.tp > 1 or model_axis else []
        axes = [("pipe", dims.pp), ("data", data), ("sequence", dims.sp), *model]
        return ProcessTopology(axes=[a for a, _ in axes], dims=[d for _, d in axes])
    if dims.tp > 1 or model_axis:
        return PipeModelDataParallelTopology(num_pp=dims.pp, num_mp=dims.tp, num_dp=data)
    return PipeDataParallelTopology(num_pp=dims.pp, num_dp=data)
