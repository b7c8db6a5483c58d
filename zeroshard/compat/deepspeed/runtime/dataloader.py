"""``deepspeed.runtime.dataloader``: ``RepeatingLoader`` is zeroshard's (``zeroshard.runtime.sampler``)."""

from ....runtime.sampler import RepeatingLoader

__all__ = ["RepeatingLoader"]
