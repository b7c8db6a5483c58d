"""``deepspeed.moe.layer``: DeepSpeed's ``MoE`` layer is zeroshard's (``zeroshard.moe.layer.MoE``: the same
constructor, forward, parameter names and expert-parameter tags)."""

from zeroshard.moe import MoE

__all__ = ["MoE"]
