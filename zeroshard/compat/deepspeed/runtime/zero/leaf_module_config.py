"""``deepspeed.runtime.zero.leaf_module_config``: the ``zero_optimization.leaf_module`` block. zeroshard's defaults
are empty (DeepSpeed 0.19 lists Mixtral's and Qwen's MoE blocks): without leaf modules zeroshard makes an HF MoE
model's decoder layers its gather units, which already keeps an expert no token reaches from hanging."""

from zeroshard.config.zero_optimization import LeafModuleConfig

DeepSpeedZeroLeafModuleConfig = LeafModuleConfig
DEFAULT_LEAF_MODULE_CLASSES: list[str] = []
DEFAULT_LEAF_MODULE_NAMES: list[str] = []
DEFAULT_LEAF_MODULE_NAME_SUFFIXES: list[str] = []

__all__ = [
    "DEFAULT_LEAF_MODULE_CLASSES",
    "DEFAULT_LEAF_MODULE_NAMES",
    "DEFAULT_LEAF_MODULE_NAME_SUFFIXES",
    "DeepSpeedZeroLeafModuleConfig",
]
