"""``deepspeed.pipe``: pipeline parallelism is not built in zeroshard (ZeRO, tensor and sequence parallelism are)."""

from .._not_built import not_built

_WHY = "pipeline parallelism is not built; ZeRO-3 with tensor or sequence parallelism covers large models"
PipelineModule = not_built("deepspeed.pipe.PipelineModule", _WHY)
LayerSpec = not_built("deepspeed.pipe.LayerSpec", _WHY)
TiedLayerSpec = not_built("deepspeed.pipe.TiedLayerSpec", _WHY)

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
