"""ZeRO data parallelism: flat groups and the stage 0-2 optimizer."""

from .flat_group import FlatGroup, GradState
from .optimizer import StagePolicy, ZeroOptimizer

__all__ = ["FlatGroup", "GradState", "StagePolicy", "ZeroOptimizer"]
