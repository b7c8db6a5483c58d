"""``deepspeed.zero``: zeroshard's stage-3 construction and whole-parameter access, and DeepSpeed's names that only
DeepSpeed clients use."""

import torch

from zeroshard.zero import GatheredParameters, Init
from zeroshard.zero.sharded_param import Availability

ZeroParamStatus = Availability  # what ``param.ds_status`` answers


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """DeepSpeed's way to make a module gather a parameter another module registers. zeroshard gathers by gather
    unit: a parameter used by a module other than its owner must belong to a unit that contains both, so this is
    refused with the way to get that, rather than accepted and ignored."""
    raise NotImplementedError(
        f"zero.register_external_parameter({type(module).__name__}, ...): zeroshard gathers a parameter with the "
        "gather unit of the module that registers it. Make a module that contains both the user and the owner a "
        "gather unit (zero_optimization.gather_unit_classes), or register the parameter on the module that uses it"
    )


__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "register_external_parameter"]
