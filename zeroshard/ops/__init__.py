"""Optimizer kernels users construct directly (DeepSpeed's ``deepspeed.ops`` names)."""

from . import adagrad, adam

__all__ = ["adagrad", "adam"]
