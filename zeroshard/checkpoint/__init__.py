"""Sharded, atomic, pickle-free checkpoints that load on any world size and stage."""

from .safetensors_io import CheckpointError

__all__ = ["CheckpointError"]
