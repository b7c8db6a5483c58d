"""Multi-process harness, a small GPT and parity helpers, for zeroshard's tests and users' own."""

from .delays import inject_delays
from .harness import WorkerError, WorkerHang, run_distributed

__all__ = ["WorkerError", "WorkerHang", "inject_delays", "run_distributed"]
