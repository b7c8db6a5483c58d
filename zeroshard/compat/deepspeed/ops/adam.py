"""``deepspeed.ops.adam``: ``DeepSpeedCPUAdam`` is zeroshard's compiler-free CPU Adam; ``FusedAdam`` is torch's
fused Adam(W), which needs no build step either."""

from zeroshard.ops.adam import CPUAdam, DeepSpeedCPUAdam, FusedAdam

__all__ = ["CPUAdam", "DeepSpeedCPUAdam", "FusedAdam"]
