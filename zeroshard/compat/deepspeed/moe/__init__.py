"""``deepspeed.moe``: zeroshard has no expert layers; the helpers clients call on dense models are here."""

from . import utils

__all__ = ["utils"]
