"""Collectives changed on purpose: delayed at random, to expose code that uses a result before its collective
completes; made slower from their issue, to measure what overlapping them with compute hides; or kept on the rank,
to measure the step without communication (the compute-only limit)."""

from __future__ import annotations

import contextlib
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


def slow_collectives(seconds: float, ops: tuple[str, ...] = ("all_gather",)) -> "SlowLink":
    """Make every collective of ``ops`` in this process take at least ``seconds`` from its issue to its result, as
    a slow link would: waiting for one sleeps what is left of that time, so compute between its issue and the wait
    hides it. Returns the seam, whose ``unhidden`` lists the seconds each wait slept (the part that could not be
    hidden). In effect from the call; ``seconds`` 0 stops, and so does leaving ``with slow_collectives(...)``,
    exception or not (the link it replaced is back)."""
    link = SlowLink(seconds, frozenset(ops), previous=DEFAULT_CONTEXT.slow_link)
    DEFAULT_CONTEXT.slow_link = link if seconds > 0 else None
    return link


class SlowLink:
    """The comm context's ``slow_link`` hook: collectives of ``ops`` complete ``seconds`` after their issue."""

    def __init__(self, seconds: float, ops: frozenset, previous=None):
        self.seconds, self.ops = seconds, ops
        self.previous = previous  # the hook in place before this one: back when a with block is left
        self.unhidden: list[tuple[str, float]] = []  # (op, seconds slept) per wait on a slowed collective

    def __enter__(self) -> "SlowLink":
        return self

    def __exit__(self, *exc) -> None:
        DEFAULT_CONTEXT.slow_link = self.previous

    def __call__(self, op: str, issued: float) -> None:
        if op not in self.ops:
            return
        left = max(0.0, issued + self.seconds - time.perf_counter())
        self.unhidden.append((op, left))
        if left > 0:
            time.sleep(left)


@contextlib.contextmanager
def compute_only():
    """Inside, no collective of this process leaves the rank (Note [compute-only runs] in comm/context.py): each
    gives what a group of one would, from this rank's data, so a training step does its own work and memory traffic
    without its communication -- the compute-only limit a step is measured against. The results are not the real
    ones (a loss, the weights after a step): for timing only."""
    DEFAULT_CONTEXT.compute_only += 1  # nested blocks: the outermost one's exit ends it
    try:
        yield
    finally:
        DEFAULT_CONTEXT.compute_only -= 1
