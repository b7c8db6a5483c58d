"""``deepspeed.runtime.pipe.engine``: the pipeline engine ``initialize`` returns for a ``PipelineModule`` is
zeroshard's (``zeroshard.runtime.pipeline_engine``)."""

from .....runtime.pipeline_engine import PipelineEngine
from .....runtime.pipeline_exchange import PipelineError

__all__ = ["PipelineEngine", "PipelineError"]
