"""Which layers each pipeline stage holds, pure: ``parts[s] .. parts[s + 1]`` are stage ``s``'s layer indices.

The methods are DeepSpeed's (``PipelineModule(partition_method=...)``) and must place layers exactly where DeepSpeed
places them: a client's checkpoint names each layer's file by its index, and its memory plan (diffusion-pipe on two
24 GB cards) depends on which stage a layer lands on.

- ``uniform``: the same number of layers per stage, the first ``layers % stages`` stages one more;
- ``parameters``: the layers' trainable parameter counts balanced (``balanced`` below);
- ``type:<regex>``: the layers whose class name matches balanced, one unit each;
- ``manual``: boundaries the client gives (diffusion-pipe's ``partition_split``: ``stages - 1`` layer indices);
- ``time`` (zeroshard's): the layers' measured forward + backward seconds (``zeroshard.pipe.profile``), split so the
  slowest stage is as fast as can be (:func:`partition_min_max`: the stage that takes longest sets the step's pace).

``balanced`` is the linear-partition dynamic program DeepSpeed runs: for the first ``i`` layers in ``j`` parts it
keeps the one split whose heaviest and lightest parts differ least (ties: the latest last boundary), built from the
kept split of the first ``k`` layers in ``j - 1`` parts. That is a greedy choice per cell, not the global optimum
of the spread, and it is what decides where DeepSpeed's layers go, so it is kept as is.
"""

from __future__ import annotations

import math
from typing import Sequence


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries of ``num_items`` cut into ``num_parts`` runs as equal as can be (earlier runs longer); with no
    more items than parts, one item per part and empty parts last."""
    _check_counts(num_items, num_parts)
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    base, extra = divmod(num_items, num_parts)
    return [p * base + min(p, extra) for p in range(num_parts + 1)]


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Boundaries of ``weights`` cut into ``num_parts`` consecutive runs whose sums are balanced as DeepSpeed
    balances them (see the module docstring)."""
    count, prefix = len(weights), _prefix_sums(weights, num_parts)
    if count <= num_parts:
        return partition_uniform(count, num_parts)
    inf = math.inf
    # best[i][j] = (spread, heaviest, lightest, last boundary) of the kept split of the first i layers in j parts
    best = [[(inf, inf, inf, 0)] * (num_parts + 1) for _ in range(count + 1)]
    best[0][0] = (0.0, 0.0, inf, 0)
    for i in range(1, count + 1):
        for j in range(1, min(i, num_parts) + 1):
            for k in range(i):
                _, heaviest, lightest, _ = best[k][j - 1]
                run = prefix[i] - prefix[k]
                top, bottom = max(heaviest, run), min(lightest, run)
                if top - bottom <= best[i][j][0]:
                    best[i][j] = (top - bottom, top, bottom, k)
    bounds = [count]
    for j in range(num_parts, 0, -1):
        bounds.append(best[bounds[-1]][j][3])
    return bounds[::-1]


def partition_min_max(weights: Sequence[float], num_parts: int) -> list[int]:
    """Boundaries of ``weights`` cut into ``num_parts`` consecutive non-empty runs whose largest sum is as small as
    can be (of equal ones, the earliest boundaries)."""
    count, prefix = len(weights), _prefix_sums(weights, num_parts)
    if count <= num_parts:
        return partition_uniform(count, num_parts)
    # best[j][i] = (the largest run of the best split of the first i layers in j runs, its last boundary)
    best = [[(math.inf, 0)] * (count + 1) for _ in range(num_parts + 1)]
    best[0][0] = (0.0, 0)
    for j in range(1, num_parts + 1):
        for i in range(j, count - (num_parts - j) + 1):
            best[j][i] = min(((max(best[j - 1][k][0], prefix[i] - prefix[k]), k) for k in range(j - 1, i)),
                             key=lambda c: c[0])  # fmt: skip
    bounds = [count]
    for j in range(num_parts, 0, -1):
        bounds.append(best[j][bounds[-1]][1])
    return bounds[::-1]


def partition_boundaries(
    method: str, num_stages: int, counts: Sequence[int], matches: Sequence[bool], times: Sequence[float] = ()
) -> list[int]:
    """The boundaries for ``method`` (``uniform``, ``parameters``, ``type:<regex>``, ``time``) from each layer's
    trainable parameter count (``counts``), whether its class name matched the ``type:`` pattern (``matches``) and
    its measured seconds (``times``)."""
    method = method.lower()
    if method == "time":
        return partition_min_max(list(times), num_stages)
    if method == "uniform":
        return partition_uniform(len(counts), num_stages)
    if method == "parameters":
        return partition_balanced(list(counts), num_stages)
    if method.startswith("type:"):
        if not any(matches):
            raise ValueError(f"partition_method {method!r} matches no layer's class name")
        return partition_balanced([1 if m else 0 for m in matches], num_stages)
    raise NotImplementedError(
        f"partition_method {method!r} is not implemented (it has 'uniform', 'parameters', 'type:<regex>', 'time' "
        "and, with the boundaries given, 'manual')"
    )


def manual_boundaries(split: Sequence[int], num_layers: int, num_stages: int) -> list[int]:
    """diffusion-pipe's ``manual`` partition: the first layer index of stages 1 .. stages - 1, increasing."""
    if len(split) != num_stages - 1:
        raise ValueError(f"a manual partition of {num_stages} stages gives {num_stages - 1} boundaries, got {split}")
    bounds = [0, *split, num_layers]
    if any(isinstance(b, bool) or not isinstance(b, int) for b in split) or bounds != sorted(bounds):
        raise ValueError(f"manual partition boundaries must be increasing layer indices in 0..{num_layers}: {split}")
    return bounds


def _prefix_sums(weights: Sequence[float], num_parts: int) -> list[float]:
    """The running sums of ``weights`` (0 first), checked to be finite numbers >= 0 cut into ``num_parts``."""
    _check_counts(len(weights), num_parts)
    if any(isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0 for w in weights):
        raise ValueError(f"layer weights must be finite numbers >= 0, got {list(weights)}")
    prefix = [0.0]
    for weight in weights:
        prefix.append(prefix[-1] + weight)
    return prefix


def _check_counts(num_items: int, num_parts: int) -> None:
    for name, value, low in (("items", num_items, 0), ("parts", num_parts, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"partition: number of {name} must be an int >= {low}, got {value!r}")
