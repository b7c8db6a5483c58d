"""Optimizers and learning-rate schedules by DeepSpeed name."""

from .factory import build_optimizer, check_client_optimizer
from .lamb import Lamb
from .lion import Lion
from .schedules import SCHEDULES, ScheduleRunner, build_schedule

__all__ = ["Lamb", "Lion", "SCHEDULES", "ScheduleRunner", "build_optimizer", "build_schedule", "check_client_optimizer"]
