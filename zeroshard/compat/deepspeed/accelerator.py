"""``deepspeed.accelerator``: zeroshard's accelerator, which answers DeepSpeed's accelerator calls."""

from zeroshard.accelerator import Accelerator, get_accelerator

__all__ = ["Accelerator", "get_accelerator"]
