"""``deepspeed.pipe``: layer specifications are zeroshard's (``zeroshard.pipe``); the pipeline engine that runs a
``PipelineModule`` is not built yet, so constructing one is refused by name."""

from ....pipe import LayerSpec, TiedLayerSpec
from .._not_built import not_built

PipelineModule = not_built(
    "deepspeed.pipe.PipelineModule",
    "the pipeline engine is not built yet (layer specifications, topologies, partitions and the 1F1B order are: "
    "zeroshard.pipe); ZeRO-3 with tensor or sequence parallelism covers large models",
)

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
