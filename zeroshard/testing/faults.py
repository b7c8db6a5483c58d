"""Faults put into a real engine's gradient reduction, to test that ``gradient_check`` catches them at the step they
happen (Note [gradient check] in ``zeroshard/zero/gradient_check.py``). Each reproduces a reported class of silent
wrong gradients; none is meant for training.

- :func:`drop_reduced_bucket` (after backward): one flat group's reduced gradient lost, as when a bucket is never
  reduced or its result never accumulated.
- :func:`scale_reduced_bucket` (after backward): one flat group's gradient off by a factor, as a wrong divisor
  leaves it (a ZeRO-2 norm 2.9x too low; sequence-parallel gradients left scaled by the sequence degree).
- :func:`reduce_over` (around backward): one flat group reduced over another process group of the same size.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from .. import comm


def _bucket(engine, index: int):
    buckets = engine.stack.reducer.buckets
    if not 0 <= index < len(buckets):
        raise ValueError(f"flat group {index}: the engine has {len(buckets)}")
    return buckets[index]


def drop_reduced_bucket(engine, index: int) -> None:
    """Zero flat group ``index``'s reduced gradient on this rank (call between backward and step)."""
    _bucket(engine, index).grad.zero_()


def scale_reduced_bucket(engine, index: int, factor: float) -> None:
    """Multiply flat group ``index``'s reduced gradient on this rank by ``factor`` (between backward and step)."""
    _bucket(engine, index).grad.mul_(factor)


@contextlib.contextmanager
def reduce_over(engine, index: int, group: comm.Group) -> Iterator[None]:
    """Backward inside this block reduces flat group ``index`` over ``group`` instead of its shard group."""
    bucket = _bucket(engine, index)
    if group.size != bucket.group.size:
        raise ValueError(f"reduce_over: group of {group.size} ranks, the bucket's has {bucket.group.size}")
    own, bucket.group = bucket.group, group
    try:
        yield
    finally:
        bucket.group = own


__all__ = ["drop_reduced_bucket", "reduce_over", "scale_reduced_bucket"]
