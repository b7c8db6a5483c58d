"""``deepspeed.utils.logging``: zeroshard's logger (clients call ``logger.setLevel``)."""

from __future__ import annotations

from typing import Optional

from zeroshard import comm
from zeroshard.log import logger


def log_dist(message: str, ranks: Optional[list[int]] = None, level: int = 20) -> None:
    """Log on the given ranks (all with ``[-1]``; rank 0 when not given)."""
    ranks = [0] if ranks is None else ranks
    if -1 in ranks or comm.get_rank() in ranks:
        logger.log(level, message)


def print_dist(message: str, ranks: Optional[list[int]] = None) -> None:
    """Print (whatever the log level) on the given ranks (all with ``[-1]``; rank 0 when not given)."""
    ranks = [0] if ranks is None else ranks
    if -1 in ranks or comm.get_rank() in ranks:
        print(f"[Rank {comm.get_rank()}] {message}")


def set_log_level_from_string(log_level_str: str, custom_logger=None) -> None:
    """DeepSpeed's: set its logger's level (``custom_logger`` instead when given) by name, ``"info"``,
    ``"debug"``, ...; handlers stay the program's."""
    levels = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}
    if not isinstance(log_level_str, str) or log_level_str.lower() not in levels:
        raise ValueError(f"set_log_level_from_string({log_level_str!r}): one of {sorted(levels)}")
    (custom_logger or logger).setLevel(levels[log_level_str.lower()])


__all__ = ["log_dist", "logger", "print_dist", "set_log_level_from_string"]
