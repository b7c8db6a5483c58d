"""Profiling: per-module flops of a forward on torch's flop counter (DeepSpeed's flops profiler)."""

from .flops import FlopsProfiler, get_model_profile

__all__ = ["FlopsProfiler", "get_model_profile"]
