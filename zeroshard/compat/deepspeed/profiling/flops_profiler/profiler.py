"""``deepspeed.profiling.flops_profiler.profiler``."""

from zeroshard.profiling.flops import FlopsProfiler, get_model_profile

__all__ = ["FlopsProfiler", "get_model_profile"]
