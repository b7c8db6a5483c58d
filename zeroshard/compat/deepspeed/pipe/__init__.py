"""``deepspeed.pipe``: zeroshard's pipeline modules and layer specifications (``zeroshard.pipe``); ``initialize`` runs a
``PipelineModule`` (1F1B) or a ``DualPipeVModule`` (DualPipeV) on zeroshard's pipeline engine."""

from ....pipe import DualPipeVModule, LayerSpec, PipelineModule, TiedLayerSpec
from ....pipe.topology import ProcessTopology

__all__ = ["DualPipeVModule", "LayerSpec", "PipelineModule", "ProcessTopology", "TiedLayerSpec"]
