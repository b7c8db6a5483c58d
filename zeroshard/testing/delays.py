"""Collectives delayed on purpose, to expose code that uses a result before its collective completes."""

from __future__ import annotations

import random
import time

from ..comm import DEFAULT_CONTEXT, get_rank


def inject_delays(max_seconds: float, seed: int = 0) -> None:
    """Sleep a random time (up to ``max_seconds``, a different sequence on every rank) before issuing and before
    waiting on each collective of this process (every engine's context is a child of the default one); 0 stops."""
    if max_seconds <= 0:
        DEFAULT_CONTEXT.pause = None
        return
    rng = random.Random(seed * 1000 + get_rank())
    DEFAULT_CONTEXT.pause = lambda: time.sleep(rng.uniform(0, max_seconds))
