"""Pipeline parallelism as DeepSpeed's clients call it (``deepspeed.pipe``): layer specifications, process
topologies, where layers go, the order stages work in and what a stage announces before sending activations.
Everything here is pure (no communication)."""

from .messages import Announcement, PipeMessageError, TensorMeta, announce, encode, parse
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
