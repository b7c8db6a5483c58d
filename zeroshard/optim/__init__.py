"""Optimizers and learning-rate schedules by DeepSpeed name."""

from .factory import build_optimizer, check_client_optimizer
from .lamb import Lamb, ShardedNorms
from .lion import Lion
from .muon import MuonWithAuxAdam, muon_param_groups
from .onebit import OneBitAdam, OneBitLamb, OneBitOptimizer, ZeroOneAdam
from .schedules import SCHEDULES, ScheduleRunner, build_schedule

__all__ = [
    "SCHEDULES",
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
    "build_schedule",
    "check_client_optimizer",
    "muon_param_groups",
]
