"""``deepspeed.runtime.swap_tensor``: the size below which DeepSpeed does not swap a tensor to NVMe."""

MIN_AIO_BYTES = 1024**2
MIN_SWAPPABLE_BYTES = MIN_AIO_BYTES

__all__ = ["MIN_AIO_BYTES", "MIN_SWAPPABLE_BYTES"]
