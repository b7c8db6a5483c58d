"""Pipeline parallelism as DeepSpeed's clients call it (``deepspeed.pipe``): layer specifications, process
topologies as views of the mesh, where layers go, the order stages work in and what a stage announces before sending
activations, all pure (no communication); the module a pipeline trains (``PipelineModule``: each rank builds its
stage's layers); the protocol between neighbouring stages (``exchange.py``) and DeepSpeed's grid getters over the mesh
(``grid.py``). The engine that runs it is ``zeroshard.runtime.pipeline_engine``."""

from .exchange import PipelineError, StageAborted, StageExchange
from .grid import PipelineGrid
from .messages import Announcement, PipeMessageError, TensorMeta, announce, encode, parse
from .module import PipelineModule
from .partition import manual_boundaries, partition_balanced, partition_boundaries, partition_uniform
from .schedule import KINDS, Step, eval_steps, train_steps
from .spec import LayerSpec, TiedLayerSpec
from .topology import (
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessTopology,
    parallel_dims,
    pipeline_topology,
)

__all__ = [
    "Announcement",
    "KINDS",
    "LayerSpec",
    "PipeDataParallelTopology",
    "PipeMessageError",
    "PipeModelDataParallelTopology",
    "PipelineError",
    "PipelineGrid",
    "PipelineModule",
    "ProcessTopology",
    "StageAborted",
    "StageExchange",
    "Step",
    "TensorMeta",
    "TiedLayerSpec",
    "announce",
    "encode",
    "eval_steps",
    "manual_boundaries",
    "partition_balanced",
    "partition_boundaries",
    "parallel_dims",
    "parse",
    "partition_uniform",
    "pipeline_topology",
    "train_steps",
]
