"""``deepspeed.runtime.pipe.module``: the pipeline module and layer specifications are zeroshard's
(``zeroshard.pipe``)."""

from .....pipe import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
