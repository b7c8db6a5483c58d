"""``deepspeed.runtime.pipe.topology``: DeepSpeed's process topologies (``zeroshard.pipe.topology``; gpt-neox builds
``PipeModelDataParallelTopology`` for its mpu)."""

from .....pipe.topology import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology

__all__ = ["PipeDataParallelTopology", "PipeModelDataParallelTopology", "ProcessTopology"]
