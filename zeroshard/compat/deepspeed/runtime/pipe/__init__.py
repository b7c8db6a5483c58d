"""``deepspeed.runtime.pipe``: the names DeepSpeed exports here, zeroshard's."""

from . import dualpipev, engine, module, p2p, schedule, topology
from .module import LayerSpec, PipelineModule, TiedLayerSpec
from .topology import ProcessTopology

__all__ = [
    "LayerSpec",
    "PipelineModule",
    "ProcessTopology",
    "TiedLayerSpec",
    "dualpipev",
    "engine",
    "module",
    "p2p",
    "schedule",
    "topology",
]
