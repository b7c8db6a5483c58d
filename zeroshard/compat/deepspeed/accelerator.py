"""``deepspeed.accelerator``: zeroshard's accelerator, which answers DeepSpeed's accelerator calls."""

from zeroshard.accelerator import Accelerator, get_accelerator


def is_current_accelerator_supported() -> bool:
    """DeepSpeed asks whether its kernels exist for this device kind; zeroshard runs the same code on CPU and GPU."""
    return get_accelerator().device().type in ("cpu", "cuda")


__all__ = ["Accelerator", "get_accelerator", "is_current_accelerator_supported"]
