"""``deepspeed.profiling``."""
