"""The ``zeroshard`` logger. A library configures no logging when imported: the logger has only a ``NullHandler``
(records go wherever the application's logging sends them). What prints the engine's rank-0 lines is configured by
whoever runs the program: the ``zeroshard`` CLI and launcher (the launcher asks its ranks through
``ZEROSHARD_LOG_LEVEL``, which ``initialize`` reads), the test harness, or a script calling :func:`log_to_stdout`."""

from __future__ import annotations

import logging
import os
import sys
from typing import Union

LEVEL_VARIABLE = "ZEROSHARD_LOG_LEVEL"  # set by the launcher for its ranks: their rank-0 lines go to stdout

logger = logging.getLogger("zeroshard")  # its NullHandler is added by the package's __init__


class _CurrentStdout(logging.StreamHandler):
    """Writes to whatever ``sys.stdout`` is at the time, so redirection and test capture see the log."""

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it; the property always wins
        pass


def log_to_stdout(level: Union[int, str] = logging.INFO) -> None:
    """Print zeroshard's lines (``[zeroshard] ...``) on stdout at ``level``; called again, only the level changes."""
    if isinstance(level, str):
        name = level.strip().upper()
        if not isinstance(logging.getLevelName(name), int):
            raise ValueError(f"log level {level!r} is not one of DEBUG, INFO, WARNING, ERROR, CRITICAL")
        level = logging.getLevelName(name)
    if not any(isinstance(h, _CurrentStdout) for h in logger.handlers):
        handler = _CurrentStdout()
        handler.setFormatter(logging.Formatter("[zeroshard] %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False  # printed once, not again by a root handler


def log_as_launched() -> None:
    """Print on stdout when the launcher asked for it (``ZEROSHARD_LOG_LEVEL`` in the environment); else nothing."""
    level = os.environ.get(LEVEL_VARIABLE)
    if level:
        log_to_stdout(level)


def log_rank0(message: str) -> None:
    from . import comm  # here, so the launcher's CLI can configure output without importing torch

    if comm.get_rank() == 0:
        logger.info(message)
