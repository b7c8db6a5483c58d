"""Pipeline parallelism as DeepSpeed's clients call it (``deepspeed.pipe``): layer specifications, process
topologies as views of the mesh, where layers go, the order stages work in and what a stage announces before sending
activations, all pure (no communication): the instructions a stage runs and DeepSpeed's schedules of them, and
their check on paper (``simulate.py``), DualPipeV's among them (``dualpipev.py``); the module a pipeline trains
(``PipelineModule``: each rank builds its stage's layers; ``DualPipeVModule``: two stages per rank); the protocol
between neighbouring stages (``exchange.py``) and DeepSpeed's grid getters over the mesh (``grid.py``). The engine
that runs it is ``zeroshard.runtime.pipeline_engine``."""

from .dualpipev import DualPipeVSchedule
from .exchange import PipelineError, StageAborted, StageExchange
from .grid import PipelineGrid
from .messages import Announcement, PipeMessageError, TensorMeta, announce, encode, parse
from .module import DualPipeVModule, PipelineModule
from .partition import manual_boundaries, partition_balanced, partition_boundaries, partition_uniform
from .schedule import DataParallelSchedule, InferenceSchedule, PipeSchedule, TrainSchedule
from .simulate import ScheduleError, StageTrace, simulate
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
    "DataParallelSchedule",
    "DualPipeVModule",
    "DualPipeVSchedule",
    "InferenceSchedule",
    "LayerSpec",
    "PipeDataParallelTopology",
    "PipeMessageError",
    "PipeModelDataParallelTopology",
    "PipeSchedule",
    "PipelineError",
    "PipelineGrid",
    "PipelineModule",
    "ProcessTopology",
    "ScheduleError",
    "StageAborted",
    "StageExchange",
    "StageTrace",
    "TensorMeta",
    "TiedLayerSpec",
    "TrainSchedule",
    "announce",
    "encode",
    "manual_boundaries",
    "parallel_dims",
    "parse",
    "partition_balanced",
    "partition_boundaries",
    "partition_uniform",
    "pipeline_topology",
    "simulate",
]
