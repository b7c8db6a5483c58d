"""The zero-bubble schedule ZB-H1 (arXiv 2401.10241), pure: each backward split into B (the input gradients, which
the previous stage waits for) and W (the weight gradients, which nobody waits for), W deferred to where a stage
would otherwise idle.

Stage ``s`` of ``p`` runs 1F1B's forwards and B's (``p - s - 1`` forwards, then a forward and a B in turn, then the
remaining B's) and defers each W as long as it holds fewer than ``p`` micro-batches whose W has not run: ``s``
micro-batches later than a plain 1F1B would free them; after the last forward, one W follows each B and the rest
come at the end. So every stage holds at most ``p`` micro-batches' activations, 1F1B's most (its first stage's;
1F1B's stage ``s`` holds ``p - s``), and with a forward, a B and a W of equal cost the step takes ``3m + p - 1``
units against 1F1B's ``3(m + p - 1)``: the idle time per stage falls from ``3(p - 1)`` to ``p - 1`` units
(``zeroshard.pipe.simulate`` runs the schedule on that clock, ``tests/unit/pipe/test_zero_bubble.py`` checks these
counts).

Each operation becomes one step of instructions: a forward receives its activations (the first stage loads the
micro-batch, the last loads its labels), runs and sends; a B receives its output gradients, runs
``BackwardInputPass`` and sends the input gradients; a W runs ``BackwardWeightPass``. Every micro-batch has its own
slot. The engine checks the schedule on paper before running it (``zeroshard.pipe.simulate``), as any other."""

from __future__ import annotations

from typing import Iterator

from .instructions import (
    BackwardInputPass,
    BackwardWeightPass,
    ForwardPass,
    LoadMicroBatch,
    OptimizerStep,
    PipeInstruction,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
)
from .schedule import PipeSchedule


def orders(stages: int, micro_batches: int) -> list[list[tuple[str, int]]]:
    """Every stage's operations ``(kind, micro)`` in order (the module's docstring)."""
    result = []
    for stage in range(stages):
        warmup = min(stages - stage - 1, micro_batches)
        order = [("F", k) for k in range(warmup)]
        forwarded, backed, weighed = warmup, 0, 0
        while backed < micro_batches:
            if forwarded < micro_batches:
                while forwarded - weighed >= stages:  # the W's this stage must run before it may hold another
                    order.append(("W", weighed))
                    weighed += 1
                order.append(("F", forwarded))
                forwarded += 1
            order.append(("B", backed))
            backed += 1
            if forwarded == micro_batches and weighed < backed:  # after the forwards: a W fills each wait
                order.append(("W", weighed))
                weighed += 1
        result.append(order + [("W", k) for k in range(weighed, micro_batches)])
    return result


class ZeroBubbleH1Schedule(PipeSchedule):
    """ZB-H1 (the module's docstring): ``pipeline.schedule: "zb-h1"``."""

    def steps(self) -> Iterator[list[PipeInstruction]]:
        order = orders(self.stages, self.micro_batches)[self.stage_id]
        first, last = self.is_first_stage, self.is_last_stage
        for index, (kind, k) in enumerate(order):
            if kind == "F":
                cmds = [LoadMicroBatch(k)] if first or last else []
                cmds += [] if first else [RecvActivation(k)]
                cmds += [ForwardPass(k)] + ([] if last else [SendActivation(k)])
            elif kind == "B":
                cmds = ([] if last else [RecvGrad(k)]) + [BackwardInputPass(k)] + ([] if first else [SendGrad(k)])
            else:
                cmds = [BackwardWeightPass(k)]
            if index == len(order) - 1:
                cmds += [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
            yield cmds

    def num_pipe_buffers(self) -> int:
        return self.micro_batches
