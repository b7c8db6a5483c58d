"""``deepspeed.runtime.zero.stage_1_and_2``: its model-state memory estimators."""

from zeroshard.runtime.zero.stage_1_and_2 import (
    estimate_zero2_model_states_mem_needs,
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
)

__all__ = [
    "estimate_zero2_model_states_mem_needs",
    "estimate_zero2_model_states_mem_needs_all_cold",
    "estimate_zero2_model_states_mem_needs_all_live",
]
