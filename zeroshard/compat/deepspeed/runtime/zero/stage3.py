"""``deepspeed.runtime.zero.stage3``: its model-state memory estimators."""

from zeroshard.runtime.zero.stage3 import (
    estimate_zero3_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
)

__all__ = [
    "estimate_zero3_model_states_mem_needs",
    "estimate_zero3_model_states_mem_needs_all_cold",
    "estimate_zero3_model_states_mem_needs_all_live",
]
