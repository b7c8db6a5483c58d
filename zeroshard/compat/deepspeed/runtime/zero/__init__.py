"""``deepspeed.runtime.zero``."""

from zeroshard.zero import GatheredParameters, Init

from . import offload_config, partition_parameters

__all__ = ["GatheredParameters", "Init", "offload_config", "partition_parameters"]
