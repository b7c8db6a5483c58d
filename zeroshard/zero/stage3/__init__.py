"""ZeRO stage 3: module-level gather units and the hooks that gather, prefetch and free them."""

from .runtime import GatherUnit, Stage3Runtime, build_units
from .units import UnitPlan, choose_unit_modules, leaf_module_paths, plan_units, repeated_block_classes

__all__ = [
    "GatherUnit",
    "Stage3Runtime",
    "UnitPlan",
    "build_units",
    "choose_unit_modules",
    "leaf_module_paths",
    "plan_units",
    "repeated_block_classes",
]
