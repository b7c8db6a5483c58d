"""Argument types shared by the ``zeroshard`` subcommands: an out-of-range number is an argparse error (exit 2,
naming the flag), never a traceback or a value that fails later."""

from __future__ import annotations

import argparse
from typing import Callable, Optional


def bounded(low: int, high: Optional[int] = None) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            span = f"{low}-{high}" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"must be {span}, got {value}")
        return value

    return parse
