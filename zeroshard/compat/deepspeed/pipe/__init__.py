"""``deepspeed.pipe``: zeroshard's pipeline module and layer specifications (``zeroshard.pipe``); ``initialize`` runs a
``PipelineModule`` on zeroshard's pipeline engine. DeepSpeed 0.19's DualPipeV schedule is not built (refused when
constructed)."""

from ....pipe import LayerSpec, PipelineModule, TiedLayerSpec
from ....pipe.topology import ProcessTopology
from .._not_built import not_built

DualPipeVModule = not_built(
    "deepspeed.pipe.DualPipeVModule",
    "the DualPipeV schedule is not implemented; PipelineModule runs DeepSpeed's 1F1B schedule",
)

__all__ = ["DualPipeVModule", "LayerSpec", "PipelineModule", "ProcessTopology", "TiedLayerSpec"]
