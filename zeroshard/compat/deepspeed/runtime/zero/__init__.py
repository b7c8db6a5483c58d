"""``deepspeed.runtime.zero``."""

from zeroshard.zero import GatheredParameters, Init

from . import config, leaf_module_config, offload_config, partition_parameters

__all__ = ["GatheredParameters", "Init", "config", "leaf_module_config", "offload_config", "partition_parameters"]
