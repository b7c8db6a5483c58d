"""``deepspeed.runtime.zero.config``: DeepSpeed's ``zero_optimization`` model is zeroshard's (same keys, aliases and
validation: ``DeepSpeedZeroConfig(stage=3, leaf_module={...})``)."""

from zeroshard.config.zero_optimization import OffloadDevice, ZeroConfig

DeepSpeedZeroConfig = ZeroConfig

__all__ = ["DeepSpeedZeroConfig", "OffloadDevice"]
