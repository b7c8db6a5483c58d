"""ZeRO data parallelism: flat groups, the optimizer for stages 0-3, zero.Init and whole-parameter access."""

from .flat_group import FlatGroup, GradState, ParamState
from .gathered import GatheredParameters, consolidated_state_dict
from .init import Init, reset_parameters
from .optimizer import NonFiniteGradientError, StagePolicy, ZeroOptimizer
from .sharded_param import ShardedParameterError

__all__ = [
    "FlatGroup",
    "GatheredParameters",
    "GradState",
    "Init",
    "NonFiniteGradientError",
    "ParamState",
    "ShardedParameterError",
    "StagePolicy",
    "ZeroOptimizer",
    "consolidated_state_dict",
    "reset_parameters",
]
