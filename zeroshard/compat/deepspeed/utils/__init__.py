"""``deepspeed.utils``: the logger and checkpoint consolidation."""

from zeroshard.comm import is_initialized

from . import logging, zero_to_fp32
from .logging import log_dist, logger

__all__ = ["is_initialized", "log_dist", "logger", "logging", "zero_to_fp32"]
