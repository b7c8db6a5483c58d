"""Optimizers and learning-rate schedules by DeepSpeed name."""

from .contract import LayoutAware, Needs, ShardLayout, needs_of
from .factory import bind_layout, build_optimizer, check_client_optimizer, update_rule
from .lamb import Lamb
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
    "ShardLayout",
    "LayoutAware",
    "Needs",
    "needs_of",
    "bind_layout",
    "ZeroOneAdam",
    "build_optimizer",
    "update_rule",
    "build_schedule",
    "check_client_optimizer",
    "muon_param_groups",
]
