"""``deepspeed.runtime.pipe.dualpipev``: DeepSpeed 0.19's DualPipeV module is zeroshard's (``zeroshard.pipe``), and
its engine is zeroshard's one pipeline engine, which runs DualPipeV for a ``DualPipeVModule``
(``zeroshard.runtime.pipeline_engine``)."""

from .....pipe import DualPipeVModule
from .....runtime.pipeline_engine import PipelineEngine as DualPipeVEngine

__all__ = ["DualPipeVEngine", "DualPipeVModule"]
