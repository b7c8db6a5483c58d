"""``deepspeed.runtime.pipe``: the names DeepSpeed exports here, zeroshard's (``PipelineModule``: refused until the
pipeline engine lands)."""

from ...pipe import LayerSpec, PipelineModule, TiedLayerSpec
from . import topology
from .topology import ProcessTopology

__all__ = ["LayerSpec", "PipelineModule", "ProcessTopology", "TiedLayerSpec", "topology"]
