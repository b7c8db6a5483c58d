"""``deepspeed.moe``: DeepSpeed's MoE layer (``layer``: zeroshard's ``zeroshard.moe.MoE``, expert-parallel inside
ZeRO) and the helpers its clients call (``utils``: splitting optimizer groups by expert tags, ...)."""

from . import layer, utils

__all__ = ["layer", "utils"]
