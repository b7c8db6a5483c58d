"""``deepspeed.runtime.zero.offload_config``: the offload blocks and offload_states kinds under DeepSpeed's names."""

from zeroshard.config.zero_optimization import OffloadDevice, OffloadOptimizerConfig, OffloadParamConfig
from zeroshard.zero.state_offload import StateKind

OffloadDeviceEnum = OffloadDevice
DeepSpeedZeroOffloadOptimizerConfig = OffloadOptimizerConfig
DeepSpeedZeroOffloadParamConfig = OffloadParamConfig
OffloadStateTypeEnum = StateKind  # engine.offload_states(include=[...])

__all__ = [
    "DeepSpeedZeroOffloadOptimizerConfig",
    "DeepSpeedZeroOffloadParamConfig",
    "OffloadDeviceEnum",
    "OffloadStateTypeEnum",
]
