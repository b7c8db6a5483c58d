"""``deepspeed.ops.lion``."""

from zeroshard.optim import Lion

DeepSpeedCPULion = FusedLion = Lion

__all__ = ["DeepSpeedCPULion", "FusedLion"]
