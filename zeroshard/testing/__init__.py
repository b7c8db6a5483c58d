"""Multi-process harness, a small GPT and parity helpers, for zeroshard's tests and users' own."""

from .delays import compute_only, inject_delays, slow_collectives, slow_host_link
from .harness import WorkerError, WorkerHang, run_distributed

__all__ = [
    "WorkerError",
    "WorkerHang",
    "compute_only",
    "inject_delays",
    "run_distributed",
    "slow_collectives",
    "slow_host_link",
]
