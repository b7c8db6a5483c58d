"""``deepspeed.ops.sparse_attention``: DeepSpeed 0.19 removed Sparse Attention; zeroshard never built it."""

from ..._not_built import not_built

_WHY = "DeepSpeed 0.19 removed Sparse Attention"
SparseSelfAttention = not_built("deepspeed.ops.sparse_attention.SparseSelfAttention", _WHY)
BertSparseSelfAttention = not_built("deepspeed.ops.sparse_attention.BertSparseSelfAttention", _WHY)
SparsityConfig = not_built("deepspeed.ops.sparse_attention.SparsityConfig", _WHY)
FixedSparsityConfig = not_built("deepspeed.ops.sparse_attention.FixedSparsityConfig", _WHY)

__all__ = ["BertSparseSelfAttention", "FixedSparsityConfig", "SparseSelfAttention", "SparsityConfig"]
