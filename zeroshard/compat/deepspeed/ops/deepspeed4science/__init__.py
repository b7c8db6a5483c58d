"""``deepspeed.ops.deepspeed4science``: DeepSpeed4Science's CUDA kernels are not built in zeroshard."""

from ..._not_built import not_built

DS4Sci_EvoformerAttention = not_built(
    "deepspeed.ops.deepspeed4science.DS4Sci_EvoformerAttention", "a CUDA kernel of DeepSpeed4Science"
)

__all__ = ["DS4Sci_EvoformerAttention"]
