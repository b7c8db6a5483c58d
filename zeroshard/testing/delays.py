"""Collectives changed on purpose: delayed at random, to expose code that uses a result before its collective
completes; made slower from their issue, to measure what overlapping them with compute hides; or kept on the rank,
to measure the step without communication (the compute-only limit). And the link between the compute device and
host memory made as slow as a given bandwidth, to measure offload's copies on a machine whose device is its host."""

from __future__ import annotations

import contextlib
import math
import random
import threading
import time

from ..accelerator import set_host_link_seam
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


def slow_host_link(bytes_per_second: float) -> "SlowHostLink":
    """Make every copy between the compute device and host memory in this process (the gradients to an offloaded
    optimizer, the updates and offloaded shards back, checkpointed activations, ``offload_states``: each call of
    :func:`zeroshard.accelerator.copy_across` / ``moved_across``) take as long as ``bytes_per_second`` allows, as a
    PCIe link would. Each direction is one link, busy with one copy at a time; the thread that issued a copy waits
    until the link has carried it (on a GPU a pinned non-blocking copy leaves the thread free, so this errs towards
    a slower step). Returns the seam, which counts the bytes each way and the seconds waited. In effect from the
    call until leaving ``with slow_host_link(...)`` or ``bytes_per_second`` 0."""
    if isinstance(bytes_per_second, bool) or not isinstance(bytes_per_second, (int, float)):
        raise TypeError(f"slow_host_link: bytes_per_second must be a number, got {type(bytes_per_second).__name__}")
    if not math.isfinite(bytes_per_second) or bytes_per_second < 0:
        raise ValueError(f"slow_host_link: bytes_per_second must be finite and >= 0 (0 stops), got {bytes_per_second}")
    link = SlowHostLink(bytes_per_second)
    link.previous = set_host_link_seam(link if bytes_per_second > 0 else None)
    return link


class SlowHostLink:
    """The host link seam: copies each way queue on a link of ``bytes_per_second``."""

    def __init__(self, bytes_per_second: float):
        self.bytes_per_second = bytes_per_second
        self.previous = None  # the seam in place before this one: back when a with block is left
        self.moved = {"to_host": 0, "to_device": 0}  # bytes carried each way
        self.waited_s = 0.0  # seconds the issuing threads waited beyond the copies themselves
        self._free_at = {True: 0.0, False: 0.0}  # when each direction's link finishes what it was given
        self._lock = threading.Lock()  # the training thread and a step's worker both copy

    def __enter__(self) -> "SlowHostLink":
        return self

    def __exit__(self, *exc) -> None:
        set_host_link_seam(self.previous)

    def __call__(self, nbytes: int, to_host: bool, started: float) -> None:
        with self._lock:
            done = max(started, self._free_at[to_host]) + nbytes / self.bytes_per_second
            self._free_at[to_host] = done
            self.moved["to_host" if to_host else "to_device"] += nbytes
            left = max(0.0, done - time.perf_counter())
            self.waited_s += left
        if left > 0:
            time.sleep(left)
