"""``deepspeed.runtime``."""

from . import (
    activation_checkpointing,
    base_optimizer,
    checkpoint_engine,
    config,
    dataloader,
    engine,
    lr_schedules,
    pipe,
    sequence_parallel,
    swap_tensor,
    utils,
    zero,
)

__all__ = [
    "activation_checkpointing", "base_optimizer", "checkpoint_engine",
    "config", "dataloader", "engine", "lr_schedules", "pipe",
    "sequence_parallel", "swap_tensor", "utils", "zero",
]  # fmt: skip
