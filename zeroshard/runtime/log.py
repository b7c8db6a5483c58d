"""Rank-0 logging to stdout, so launcher output stays readable with many ranks."""

from __future__ import annotations

import logging
import sys

from .. import comm

logger = logging.getLogger("zeroshard")
if not logger.handlers:
    _handler = logging.StreamHandler(sys.stdout)
    _handler.setFormatter(logging.Formatter("[zeroshard] %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def log_rank0(message: str) -> None:
    if comm.get_rank() == 0:
        logger.info(message)
