"""Rank-0 logging to stdout, so launcher output stays readable with many ranks."""

from __future__ import annotations

import logging
import sys

from .. import comm


class _CurrentStdout(logging.StreamHandler):
    """Writes to whatever ``sys.stdout`` is at the time, so redirection and test capture see the log."""

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it; the property always wins
        pass


logger = logging.getLogger("zeroshard")
if not logger.handlers:
    _handler = _CurrentStdout()
    _handler.setFormatter(logging.Formatter("[zeroshard] %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def log_rank0(message: str) -> None:
    if comm.get_rank() == 0:
        logger.info(message)
