"""``deepspeed.runtime.pipe.module``: the pipeline module and layer specifications are zeroshard's
(``zeroshard.pipe``)."""

from .....pipe import DualPipeVModule, LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["DualPipeVModule", "LayerSpec", "PipelineModule", "TiedLayerSpec"]
