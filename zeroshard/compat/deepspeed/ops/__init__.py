"""``deepspeed.ops``: optimizers clients construct directly."""

from . import adagrad, adam, deepspeed4science, lion, op_builder, sparse_attention

__all__ = ["adagrad", "adam", "deepspeed4science", "lion", "op_builder", "sparse_attention"]
