"""Lightning integration: ``ZeroshardStrategy`` for the Trainer, ``ZeroshardFabricStrategy`` for Fabric, and
``convert_zero_checkpoint_to_fp32_state_dict`` for Lightning checkpoint directories.

Importing this package registers the strategy names ``"zeroshard"``, ``"zeroshard_stage_1"``,
``"zeroshard_stage_2"``, ``"zeroshard_stage_2_offload"``, ``"zeroshard_stage_3"``, ``"zeroshard_stage_3_offload"``
and ``"zeroshard_stage_3_offload_nvme"`` with Lightning (``Trainer(strategy="zeroshard_stage_3")``) and Fabric.
Needs ``pip install zeroshard[lightning]``."""

from lightning.fabric.strategies import STRATEGY_REGISTRY as _FABRIC_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry as _TRAINER_REGISTRY

from .convert import convert_zero_checkpoint_to_fp32_state_dict
from .fabric import ZeroshardFabricStrategy
from .precision import ZeroshardPrecision
from .strategy import ZeroshardStrategy

ZeroshardStrategy.register_strategies(_TRAINER_REGISTRY)
ZeroshardFabricStrategy.register_strategies(_FABRIC_REGISTRY)

__all__ = [
    "ZeroshardFabricStrategy",
    "ZeroshardPrecision",
    "ZeroshardStrategy",
    "convert_zero_checkpoint_to_fp32_state_dict",
]
