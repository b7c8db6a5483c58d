"""The order each pipeline stage runs its work in, pure: one-forward-one-backward (1F1B) for training, forwards
only for evaluation.

Stage ``s`` of ``p`` with ``m`` micro-batches first runs ``min(p - s - 1, m)`` forwards (the warm-up: the later
stages need that many before the first gradient comes back), then alternates one forward and one backward, then
drains the remaining backwards; so it never holds more than ``p - s`` micro-batches' activations (GPipe holds
``m``). The compute order per stage is DeepSpeed's ``TrainSchedule``'s; the exchanges are written beside it as
separate steps: a stage receives an activation before its forward and sends the output after, receives the output's
gradient before its backward and sends the input's gradient after. Sends do not wait for the receiver (the engine
issues them asynchronously), receives do; with that, every stage's next receive has a matching send earlier in the
sender's order, so the schedule cannot deadlock (``tests/unit/pipe/test_schedule.py`` runs every stage to the end).
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("recv_activation", "forward", "send_activation", "recv_grad", "backward", "send_grad")


@dataclass(frozen=True)
class Step:
    """One piece of a stage's work on micro-batch ``micro`` (``kind`` in :data:`KINDS`)."""

    kind: str
    micro: int


def train_steps(stage: int, stages: int, micro_batches: int) -> list[Step]:
    """Stage ``stage``'s 1F1B order over ``micro_batches`` micro-batches."""
    _check(stage, stages, micro_batches)
    warmup = min(stages - stage - 1, micro_batches)
    order = [("forward", i) for i in range(warmup)]
    for i in range(micro_batches - warmup):
        order += [("forward", warmup + i), ("backward", i)]
    order += [("backward", i) for i in range(micro_batches - warmup, micro_batches)]
    return [step for kind, micro in order for step in _with_exchanges(kind, micro, stage, stages)]


def eval_steps(stage: int, stages: int, micro_batches: int) -> list[Step]:
    """Stage ``stage``'s forwards over ``micro_batches`` micro-batches, in order."""
    _check(stage, stages, micro_batches)
    return [step for i in range(micro_batches) for step in _with_exchanges("forward", i, stage, stages)]


def _with_exchanges(kind: str, micro: int, stage: int, stages: int) -> list[Step]:
    first, last = stage == 0, stage == stages - 1
    if kind == "forward":
        before, after = (None if first else "recv_activation"), (None if last else "send_activation")
    else:
        before, after = (None if last else "recv_grad"), (None if first else "send_grad")
    return [Step(k, micro) for k in (before, kind, after) if k is not None]


def _check(stage: int, stages: int, micro_batches: int) -> None:
    for name, value, low in (("stages", stages, 1), ("micro_batches", micro_batches, 1), ("stage", stage, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"pipeline schedule: {name} must be an int >= {low}, got {value!r}")
    if stage >= stages:
        raise ValueError(f"pipeline schedule: stage {stage} of {stages} stages does not exist")
