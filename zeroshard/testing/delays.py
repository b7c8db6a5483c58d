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
    DEFAULT_CONTEXT.pause = RandomPause(max_seconds, random.Random(seed * 1000 + get_rank()))


class RandomPause:
    """A sleep of up to ``max_seconds``, drawn from this rank's generator: the comm context's ``pause`` hook."""

    def __init__(self, max_seconds: float, rng: random.Random):
        self.max_seconds, self.rng = max_seconds, rng

    def __call__(self) -> None:
        time.sleep(self.rng.uniform(0, self.max_seconds))
