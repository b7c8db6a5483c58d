"""``deepspeed.zero``: zeroshard's stage-3 construction and whole-parameter access."""

from zeroshard.zero import GatheredParameters, Init
from zeroshard.zero.sharded_param import ZeroParamStatus, register_external_parameter

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "register_external_parameter"]
