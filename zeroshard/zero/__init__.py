"""ZeRO data parallelism: flat groups, the optimizer for stages 0-3, and whole-parameter access."""

from .flat_group import FlatGroup, GradState, ParamState
from .gathered import GatheredParameters, consolidated_state_dict
from .optimizer import StagePolicy, ZeroOptimizer
from .sharded_param import ShardedParameterError

__all__ = [
    "FlatGroup",
    "GatheredParameters",
    "GradState",
    "ParamState",
    "ShardedParameterError",
    "StagePolicy",
    "ZeroOptimizer",
    "consolidated_state_dict",
]
