"""``deepspeed.ops.op_builder``: zeroshard compiles nothing (its CPU Adam and NVMe offload are plain torch / Python),
so DeepSpeed's extension builders have nothing to build; NVMe offload is the config's ``offload_*: nvme``."""

from ..._not_built import not_built

_WHY = "zeroshard builds no C++/CUDA extensions; use the config's offload_optimizer / offload_param with nvme"
# NAME: the op name each builder carries (DeepSpeed's tests look compatibility up by it)
AsyncIOBuilder = not_built("deepspeed.ops.op_builder.AsyncIOBuilder", _WHY, NAME="async_io")
GDSBuilder = not_built("deepspeed.ops.op_builder.GDSBuilder", _WHY, NAME="gds")
CPUAdamBuilder = not_built("deepspeed.ops.op_builder.CPUAdamBuilder", _WHY, NAME="cpu_adam")
FusedAdamBuilder = not_built("deepspeed.ops.op_builder.FusedAdamBuilder", _WHY, NAME="fused_adam")

__all__ = ["AsyncIOBuilder", "CPUAdamBuilder", "FusedAdamBuilder", "GDSBuilder"]
