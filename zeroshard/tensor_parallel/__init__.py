"""Tensor parallelism: which layer splits how (``placement``, pure), the layers that hold one rank's slice
(``layers``), and sharding a model in place (``shard``) for inference and for training."""

from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, VocabParallelHead
from .placement import LayerSpec, PlacementError, TensorParallelPlan, layer_specs_from, plan_tensor_parallel
from .shard import (
    Cast,
    check_forward,
    set_autotp_mode,
    shard_for_training,
    shard_layers,
    sharded_group,
    splits_at,
    tensor_splits,
    tp_model_init,
)

__all__ = [
    "Cast",
    "check_forward",
    "ColumnParallelLinear",
    "LayerSpec",
    "PlacementError",
    "RowParallelLinear",
    "TensorParallelPlan",
    "VocabParallelEmbedding",
    "VocabParallelHead",
    "layer_specs_from",
    "plan_tensor_parallel",
    "set_autotp_mode",
    "shard_for_training",
    "shard_layers",
    "sharded_group",
    "splits_at",
    "tensor_splits",
    "tp_model_init",
]
