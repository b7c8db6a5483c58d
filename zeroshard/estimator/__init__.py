"""``zeroshard.estimate``: the per-rank peak memory of a training run, before running it (``predict.py`` says what
is counted and how)."""

from .cli import Candidate, main, parse_bytes
from .predict import estimate
from .process import allocator_retention, runtime_baseline
from .result import CATEGORIES, LOCATIONS, MemoryEstimate

__all__ = [
    "CATEGORIES",
    "LOCATIONS",
    "Candidate",
    "MemoryEstimate",
    "allocator_retention",
    "estimate",
    "main",
    "parse_bytes",
    "runtime_baseline",
]
