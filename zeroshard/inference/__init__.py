"""Tensor-parallel inference: ``init_inference`` shards a model's layers over ranks and serves it."""

from .engine import InferenceEngine, init_empty_weights, init_inference, tp_model_init
from .placement import PlacementError, TensorParallelPlan, plan_tensor_parallel

__all__ = [
    "InferenceEngine",
    "PlacementError",
    "TensorParallelPlan",
    "init_empty_weights",
    "init_inference",
    "tp_model_init",
    "plan_tensor_parallel",
]
