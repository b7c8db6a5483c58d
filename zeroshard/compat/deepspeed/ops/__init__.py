"""``deepspeed.ops``: optimizers clients construct directly."""

from ..git_version_info import compatible_ops
from . import adagrad, adam, aio, deepspeed4science, lion, op_builder, sparse_attention

__compatible_ops__ = dict(compatible_ops)  # DeepSpeed's tests skip cases whose op is not compatible

__all__ = ["adagrad", "adam", "aio", "deepspeed4science", "lion", "op_builder", "sparse_attention"]
