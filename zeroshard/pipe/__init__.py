"""Pipeline parallelism as DeepSpeed's clients call it (``deepspeed.pipe``): layer specifications, process
topologies, where layers go, the order stages work in and what a stage announces before sending activations, all
pure (no communication); and the module a pipeline trains (``PipelineModule``: each rank builds its stage's layers).
The engine that runs it is ``zeroshard.runtime.pipeline_engine``."""

from .messages import Announcement, PipeMessageError, TensorMeta, announce, encode, parse
from .module import PipelineModule
from .partition import manual_boundaries, partition_balanced, partition_boundaries, partition_uniform
from .schedule import KINDS, Step, eval_steps, train_steps
from .spec import LayerSpec, TiedLayerSpec
from .topology import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology

__all__ = [
    "Announcement",
    "KINDS",
    "LayerSpec",
    "PipeDataParallelTopology",
    "PipeMessageError",
    "PipeModelDataParallelTopology",
    "PipelineModule",
    "ProcessTopology",
    "Step",
    "TensorMeta",
    "TiedLayerSpec",
    "announce",
    "encode",
    "eval_steps",
    "manual_boundaries",
    "partition_balanced",
    "partition_boundaries",
    "parse",
    "partition_uniform",
    "train_steps",
]
