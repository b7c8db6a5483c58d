"""``deepspeed.moe``: zeroshard has no expert layers; the helpers clients call on dense models are here."""

from . import layer, utils

__all__ = ["layer", "utils"]
