"""``deepspeed.utils``: the logger, checkpoint consolidation and the stage-3 leaf-module flags
(``deepspeed.utils.z3_leaf_module`` is a function there, as in DeepSpeed)."""

from zeroshard.comm import is_initialized

from . import leaf_modules, logging, zero_to_fp32
from .leaf_modules import *  # noqa: F403
from .logging import log_dist, logger

__all__ = ["is_initialized", "log_dist", "logger", "logging", "zero_to_fp32", *leaf_modules.__all__]
