"""``deepspeed.runtime.zero.config``: DeepSpeed's ``zero_optimization`` model is zeroshard's (same keys, aliases and
validation: ``DeepSpeedZeroConfig(stage=3, leaf_module={...})``)."""

from zeroshard.config.schema import OffloadDevice, ZeroConfig

DeepSpeedZeroConfig = ZeroConfig
ZeroStageEnum = int  # DeepSpeed's enum of stage numbers; zeroshard's stage is the number itself

__all__ = ["DeepSpeedZeroConfig", "OffloadDevice", "ZeroStageEnum"]
