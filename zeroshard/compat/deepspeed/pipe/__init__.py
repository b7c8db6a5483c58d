"""``deepspeed.pipe``: zeroshard's pipeline module and layer specifications (``zeroshard.pipe``); ``initialize`` runs a
``PipelineModule`` on zeroshard's pipeline engine."""

from ....pipe import LayerSpec, PipelineModule, TiedLayerSpec
from ....pipe.topology import ProcessTopology

__all__ = ["LayerSpec", "PipelineModule", "ProcessTopology", "TiedLayerSpec"]
