"""Pipeline parallelism as DeepSpeed's clients call it (``deepspeed.pipe``): layer specifications, process
topologies, where layers go and the order stages work in. Everything here is pure (no communication)."""

from .partition import manual_boundaries, partition_balanced, partition_boundaries, partition_uniform
from .schedule import KINDS, Step, eval_steps, train_steps
from .spec import LayerSpec, TiedLayerSpec
from .topology import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology

__all__ = [
    "KINDS",
    "LayerSpec",
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "ProcessTopology",
    "Step",
    "TiedLayerSpec",
    "eval_steps",
    "manual_boundaries",
    "partition_balanced",
    "partition_boundaries",
    "partition_uniform",
    "train_steps",
]
