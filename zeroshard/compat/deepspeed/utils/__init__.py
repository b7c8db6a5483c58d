"""``deepspeed.utils``: the logger, checkpoint consolidation, the stage-3 leaf-module flags
(``deepspeed.utils.z3_leaf_module`` is a function there, as in DeepSpeed) and one parameter's training state
(``safe_get_full_fp32_param`` and its family), the process-group getters (``groups``)."""

from zeroshard.comm import is_initialized
from zeroshard.runtime.sampler import RepeatingLoader

from . import groups, leaf_modules, logging, tensor_fragment, timer, zero_to_fp32
from .leaf_modules import *  # noqa: F403
from .logging import log_dist, logger, print_dist, set_log_level_from_string
from .tensor_fragment import *  # noqa: F403

__all__ = [
    "RepeatingLoader",
    "groups",
    "is_initialized",
    "log_dist",
    "logger",
    "logging",
    "print_dist",
    "set_log_level_from_string",
    "timer",
    "zero_to_fp32",
    *leaf_modules.__all__,
    *tensor_fragment.__all__,
]
