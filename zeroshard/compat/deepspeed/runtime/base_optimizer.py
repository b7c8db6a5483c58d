"""``deepspeed.runtime.base_optimizer``: the class of ``engine.optimizer`` (clients test ``isinstance`` against it)."""

from zeroshard.zero import ZeroOptimizer

DeepSpeedOptimizer = ZeroOptimizer
ZeROOptimizer = ZeroOptimizer

__all__ = ["DeepSpeedOptimizer", "ZeROOptimizer"]
