"""Optimizers and learning-rate schedules by DeepSpeed name."""

import torch

from .factory import build_optimizer, check_client_optimizer, update_rule
from .lamb import Lamb, ShardedNorms
from .lion import Lion
from .muon import MuonWithAuxAdam, muon_param_groups
from .onebit import OneBitAdam, OneBitLamb, OneBitOptimizer, ZeroOneAdam
from .schedules import SCHEDULES, ScheduleRunner, build_schedule

# optimizers whose update of a parameter depends on the whole parameter (Lamb's trust ratio, Muon's Newton-Schulz
# orthogonalization), not elementwise: a tensor-parallel rank holds only a piece of a split matrix
WHOLE_PARAMETER_OPTIMIZERS = (
    Lamb,
    OneBitLamb,
    MuonWithAuxAdam,
    *((torch.optim.Muon,) if hasattr(torch.optim, "Muon") else ()),
)

__all__ = [
    "SCHEDULES",
    "WHOLE_PARAMETER_OPTIMIZERS",
    "Lamb",
    "Lion",
    "MuonWithAuxAdam",
    "OneBitAdam",
    "OneBitLamb",
    "OneBitOptimizer",
    "ScheduleRunner",
    "ShardedNorms",
    "ZeroOneAdam",
    "build_optimizer",
    "update_rule",
    "build_schedule",
    "check_client_optimizer",
    "muon_param_groups",
]
