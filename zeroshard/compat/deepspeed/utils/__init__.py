"""``deepspeed.utils``: the logger, checkpoint consolidation and the stage-3 leaf-module marks."""

from zeroshard.comm import is_initialized

from . import logging, zero_to_fp32
from .leaf_modules import (
    get_z3_leaf_modules,
    set_z3_leaf_module,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,  # a function, as DeepSpeed's deepspeed.utils.z3_leaf_module
    z3_leaf_parameter,
)
from .logging import log_dist, logger

__all__ = [
    "get_z3_leaf_modules",
    "is_initialized",
    "log_dist",
    "logger",
    "logging",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
    "z3_leaf_parameter",
    "zero_to_fp32",
]
