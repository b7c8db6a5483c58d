"""``deepspeed.runtime.zero.offload_config``: the offload blocks of zeroshard's config under DeepSpeed's names."""

from zeroshard.config.schema import OffloadDevice, OffloadOptimizerConfig, OffloadParamConfig

OffloadDeviceEnum = OffloadDevice
DeepSpeedZeroOffloadOptimizerConfig = OffloadOptimizerConfig
DeepSpeedZeroOffloadParamConfig = OffloadParamConfig

__all__ = ["DeepSpeedZeroOffloadOptimizerConfig", "DeepSpeedZeroOffloadParamConfig", "OffloadDeviceEnum"]
