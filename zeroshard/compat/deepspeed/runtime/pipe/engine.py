"""``deepspeed.runtime.pipe.engine``: the pipeline engine ``initialize`` returns for a ``PipelineModule`` is
zeroshard's (``zeroshard.runtime.pipeline_engine``)."""

from .....pipe import PipelineError
from .....runtime.pipeline_engine import PipelineEngine

__all__ = ["PipelineEngine", "PipelineError"]
