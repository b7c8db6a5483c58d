"""The stage-3 gather schedule: what one forward's unit order says about the step that follows (pure: no processes).

Every rank runs its gather units in the same order (the gathers are collectives), and a training step runs that
order forward and then reversed in backward. Recording it once is enough to plan the rest: which units to gather
ahead of need (in forward the ones that come next, in backward the ones that ran before), and which to keep
gathered after their forward because they are needed again soon (DeepSpeed's ``stage3_max_reuse_distance``).

Note [reuse distance]: a unit's reuse distance after its forward at position ``i`` is the number of elements of the
other units that run between that use and its next one: a later call in the same forward (a block run twice), or
else its backward, which in the reversed order comes after the backward of every unit that ran after it. The last
unit of forward has distance 0 (its backward is next), the first about twice the model. DeepSpeed keeps a
parameter whose reuse lies within ``stage3_max_reuse_distance`` parameters; here a unit is kept when its distance is
at most that, so 0 keeps exactly the units whose next use needs nothing else gathered first -- the last one of
forward, freed and gathered again at once otherwise (as torchtitan leaves its last block unsharded after forward).
"""

from __future__ import annotations

from itertools import accumulate
from typing import Callable, Generic, Hashable, Optional, Sequence, TypeVar

Unit = TypeVar("Unit", bound=Hashable)


class GatherSchedule(Generic[Unit]):
    """One forward's unit order (``order``, each unit's element count from ``numel``) and what it implies for the
    step: the units ahead of each point in forward and backward, and whether a unit is kept after each forward use
    (``keeps(i)``: its reuse distance, Note [reuse distance], at most ``max_reuse_distance``)."""

    def __init__(self, order: Sequence[Unit], numel: Callable[[Unit], int], max_reuse_distance: int):
        self.order = tuple(order)
        n = len(self.order)
        trace = self.order + self.order[::-1]  # forward, then backward in reverse
        before = [0, *accumulate(numel(u) for u in trace)]  # before[k]: elements run before trace position k
        self._last_forward = {unit: i for i, unit in enumerate(self.order)}
        # the next use of the unit at position i: its next forward call, else (i is its last call) its backward,
        # at trace position 2n - 1 - i; nothing between is the unit itself either way
        reuse, seen = [0] * n, {}
        for i in reversed(range(n)):
            reuse[i] = seen.get(self.order[i], 2 * n - 1 - i)
            seen[self.order[i]] = i
        self._distance = [before[reuse[i]] - before[i + 1] for i in range(n)]
        self.max_reuse_distance = max_reuse_distance

    def __len__(self) -> int:
        return len(self.order)

    def follows(self, recorded: Sequence[Unit]) -> bool:
        """Whether a forward that ran ``recorded`` so far is still on this schedule."""
        position = len(recorded) - 1
        return 0 <= position < len(self.order) and self.order[position] == recorded[-1]

    def reuse_distance(self, position: int) -> int:
        """Elements of other units run between the forward use at ``position`` and the unit's next use."""
        return self._distance[position]

    def keeps(self, position: int) -> bool:
        """Whether the unit stays gathered after its forward use at ``position`` (Note [reuse distance])."""
        return self._distance[position] <= self.max_reuse_distance

    def next_in_forward(self, position: int) -> Optional[Unit]:
        """The unit forward runs right after ``position`` (None after the last)."""
        return self.order[position + 1] if position + 1 < len(self.order) else None

    def ahead_in_forward(self, position: int) -> tuple[Unit, ...]:
        """The units forward runs after ``position``, nearest first: the candidates to gather ahead."""
        return self.order[position + 1 :]

    def ahead_in_backward(self, unit: Unit) -> tuple[Unit, ...]:
        """The units whose backward comes after ``unit``'s (those that ran before its last forward use), nearest
        first; empty for a unit this forward did not run."""
        last: Optional[int] = self._last_forward.get(unit)
        if last is None:
            return ()
        before = self.order[last - 1 :: -1] if last > 0 else ()
        return tuple(dict.fromkeys(u for u in before if u != unit))  # a unit run twice is gathered once


__all__ = ["GatherSchedule"]
