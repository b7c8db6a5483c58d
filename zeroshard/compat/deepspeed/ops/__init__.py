"""``deepspeed.ops``: optimizers clients construct directly."""

from . import adam, lion

__all__ = ["adam", "lion"]
