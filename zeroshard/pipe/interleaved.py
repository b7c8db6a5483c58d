"""Interleaved 1F1B (Megatron-LM's virtual pipeline stages; torch.distributed.pipelining's ``Interleaved1F1B``),
pure.

The model is cut into ``k p`` stages for ``p`` ranks and rank ``r`` runs stages ``r, r + p, ..., r + (k - 1) p``
(its phases ``0 .. k - 1``): a micro-batch loops through the ranks ``k`` times, from the last rank back to rank 0
between loops. Micro-batches go in groups of ``p``: a rank runs a group's forwards on its first stage, then on its
second, and so on, before the next group; backwards run the same groups through its stages in reverse. After a
warm-up of ``2 (p - r - 1) + (k - 1) p`` forwards, each forward is followed by a backward, and the remaining
backwards end the batch. Each of a rank's stages is ``1/k`` of a 1F1B stage, so the warm-up and cool-down, 1F1B's
bubble, shrink by ``k`` (on the unit clock, ``(p - 1) / (k m + p - 1)`` against ``(p - 1) / (m + p - 1)``); the
price is ``k`` times the messages between ranks, and a rank holds more activations: ``2 (p - r - 1) + (k - 1) p +
1`` stages' worth at most, each ``1/k`` of a 1F1B stage. ``m`` must be a multiple of ``p`` (Megatron's rule: the
groups fill)."""

from __future__ import annotations

from typing import Iterator

from .instructions import (
    BackwardPass,
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


class Interleaved1F1BSchedule(PipeSchedule):
    """Interleaved 1F1B for rank ``stage_id`` of ``stages`` ranks, each running ``chunks`` stages (the module's
    docstring); ``forward_only``: evaluation, every forward in the same order."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int, chunks: int = 2, forward_only: bool = False):
        super().__init__(micro_batches, stages, stage_id)
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 2:
            raise ValueError(f"interleaved 1F1B runs 2 or more stages per rank, got {chunks!r}")
        if stages < 2 or micro_batches % stages:
            raise ValueError(
                f"interleaved 1F1B needs 2 or more pipeline ranks and a number of micro-batches "
                f"(gradient_accumulation_steps) divisible by them: got {micro_batches} micro-batches on {stages}"
            )
        self.chunks, self.forward_only = chunks, forward_only

    def num_pipe_buffers(self) -> int:
        return self.chunks * self.micro_batches  # phase * micro_batches + micro_batch

    def virtual_stages(self) -> int:
        return self.chunks * self.stages

    def virtual_stage(self, phase: int = 0) -> int:
        return phase * self.stages + self.stage_id

    def owner(self, virtual_stage: int) -> int:
        return virtual_stage % self.stages

    def phase_of(self, virtual_stage: int) -> int:
        return virtual_stage // self.stages

    def handoff_slot(self, slot: int) -> int:
        return slot + self.micro_batches

    def work(self, index: int, backward: bool) -> tuple[int, int]:
        """The ``index``-th forward (or backward) of this rank: (phase, micro-batch)."""
        group, within = divmod(index, self.stages * self.chunks)
        phase = within // self.stages
        return (self.chunks - 1 - phase if backward else phase), group * self.stages + within % self.stages

    def steps(self) -> Iterator[list[PipeInstruction]]:
        total = self.chunks * self.micro_batches
        warmup = (
            total
            if self.forward_only
            else min(2 * (self.stages - self.stage_id - 1) + (self.chunks - 1) * self.stages, total)
        )
        order = [[self._forward(i)] for i in range(warmup)]
        if not self.forward_only:
            order += [[self._forward(warmup + j), self._backward(j)] for j in range(total - warmup)]
            order += [[self._backward(j)] for j in range(total - warmup, total)]
        for index, ops in enumerate(order):
            cmds = [cmd for op in ops for cmd in op]
            if index == len(order) - 1 and not self.forward_only:
                cmds += [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
            yield cmds

    def _forward(self, index: int) -> list[PipeInstruction]:
        phase, micro = self.work(index, backward=False)
        virtual, slot = self.virtual_stage(phase), phase * self.micro_batches + micro
        first, last = virtual == 0, virtual == self.virtual_stages() - 1
        cmds = [LoadMicroBatch(slot)] if first or last else []
        cmds += [] if first else [RecvActivation(slot, phase=phase)]
        return cmds + [ForwardPass(slot, phase=phase)] + ([] if last else [SendActivation(slot, phase=phase)])

    def _backward(self, index: int) -> list[PipeInstruction]:
        phase, micro = self.work(index, backward=True)
        virtual, slot = self.virtual_stage(phase), phase * self.micro_batches + micro
        first, last = virtual == 0, virtual == self.virtual_stages() - 1
        cmds = [] if last else [RecvGrad(slot, phase=phase)]
        return cmds + [BackwardPass(slot, phase=phase)] + ([] if first else [SendGrad(slot, phase=phase)])
