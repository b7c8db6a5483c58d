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


__all__ = ["log_dist", "logger", "print_dist"]
