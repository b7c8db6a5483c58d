"""Optimizer kernels users construct directly (DeepSpeed's ``deepspeed.ops`` names)."""

from . import adam

__all__ = ["adam"]
