"""``deepspeed.ops.adagrad``: ``DeepSpeedCPUAdagrad`` is torch's Adagrad with DeepSpeed's arguments."""

from zeroshard.ops.adagrad import CPUAdagrad, DeepSpeedCPUAdagrad

__all__ = ["CPUAdagrad", "DeepSpeedCPUAdagrad"]
