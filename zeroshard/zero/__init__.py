"""ZeRO data parallelism: flat groups, gradient reduction, optimizer state in its home, the optimizer for
stages 0-3, zero.Init and whole-parameter access."""

from .assemble import Placement, build_zero_stack
from .buffers import ReusableBuffers
from .flat_group import FlatGroup, ParamState
from .gathered import GatheredParameters, consolidated_state_dict
from .init import Init, parameters_replaced
from .materialize import reset_parameters
from .offloaded_state import HostState, NvmeState
from .optimizer import ZeroOptimizer
from .optimizer_home import build_optimizer_state
from .optimizer_state import DeviceState, OptimizerState
from .param_access import ParamAccess
from .planning import StagePolicy, leaf_paths_of
from .reducer import GradBucket, GradientReducer, GradState
from .sharded_param import ParamRecords, ShardedParameterError
from .stack import NonFiniteGradientError, ZeroStack
from .step_behind import StepBehindError

__all__ = [
    "DeviceState",
    "FlatGroup",
    "GatheredParameters",
    "GradBucket",
    "GradState",
    "GradientReducer",
    "HostState",
    "Init",
    "NonFiniteGradientError",
    "NvmeState",
    "OptimizerState",
    "Placement",
    "ParamAccess",
    "ParamRecords",
    "ParamState",
    "ReusableBuffers",
    "ShardedParameterError",
    "StagePolicy",
    "StepBehindError",
    "leaf_paths_of",
    "ZeroOptimizer",
    "ZeroStack",
    "build_optimizer_state",
    "build_zero_stack",
    "consolidated_state_dict",
    "parameters_replaced",
    "reset_parameters",
]
