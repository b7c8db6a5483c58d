"""Tensor-parallel inference: ``init_inference`` shards a model's layers over ranks and serves it."""

from ..tensor_parallel import PlacementError
from .engine import InferenceEngine, init_empty_weights, init_inference

__all__ = ["InferenceEngine", "PlacementError", "init_empty_weights", "init_inference"]
