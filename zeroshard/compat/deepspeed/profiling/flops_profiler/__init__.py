"""``deepspeed.profiling.flops_profiler``: zeroshard's flops profiler (:mod:`zeroshard.profiling.flops`) under
DeepSpeed's names; ``profiler`` is the module path DeepSpeed's own code and some clients import from."""

from zeroshard.profiling.flops import (
    FlopsProfiler,
    duration_to_string,
    get_model_profile,
    number_to_string,
)

from . import profiler

__all__ = ["FlopsProfiler", "duration_to_string", "get_model_profile", "number_to_string", "profiler"]
