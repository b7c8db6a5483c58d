"""The DualPipeV schedule (DeepSeek-V3's DualPipe folded into a V, as DeepSpeed 0.19 names it), pure.

The model is cut into ``2p`` stages for ``p`` ranks; rank ``r`` runs stage ``r`` (phase 0) and stage ``2p - 1 - r``
(phase 1). A micro-batch goes out through the phase-0 stages, turns on the last rank (whose two stages are
consecutive: the activations pass from one to the other without an exchange) and comes back through the phase-1
stages to rank 0, which computes the loss: rank 0 both reads the data and holds the loss. Each rank runs forwards of
one phase interleaved with backwards of the other, which fills most of 1F1B's warm-up and cool-down; it needs at
least ``2p`` micro-batches.

:class:`DualPipeVSchedule` yields DeepSpeed 0.19.8's instructions for this order step for step (its
``DualPipeVSchedule``: the same classes, buffers ``phase * m + micro_batch`` and ``phase`` fields, ``CommitP2P`` where
it launches its batched point-to-point operations; ``tests/fixtures/deepspeed_pipe`` holds its streams). With
``split_backward`` (zeroshard's default where the stack allows it) the backwards DualPipe's own reference defers
are split into the input gradients (``BackwardInputPass``, sent on at once) and the weight gradients
(``BackwardWeightPass``), which run in the places DeepSpeed's schedule leaves empty (its "weight chunks"): the
cool-down's backwards and the first backward of each phase-1 chunk of the warm-up; the weight passes run oldest
first. The instructions run in the same order otherwise, so the split changes no slot and no exchange."""

from __future__ import annotations

from collections import deque
from typing import Iterator

from .instructions import (
    BackwardInputPass,
    BackwardPass,
    BackwardWeightPass,
    CommitP2P,
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


class DualPipeVSchedule(PipeSchedule):
    """DualPipeV for rank ``stage_id`` of ``stages`` ranks (the module's docstring); ``forward_only``: evaluation
    (forwards and exchanges of activations only); ``split_backward``: B and W apart where DualPipe defers W."""

    def __init__(
        self, micro_batches: int, stages: int, stage_id: int, forward_only: bool = False, split_backward: bool = False
    ):
        super().__init__(micro_batches, stages, stage_id)
        if micro_batches < 2 * stages:
            raise ValueError(
                f"DualPipeV needs at least 2 * {stages} micro-batches (gradient_accumulation_steps) for {stages} "
                f"pipeline ranks, got {micro_batches}"
            )
        self.forward_only, self.split_backward = forward_only, split_backward and not forward_only

    def num_pipe_buffers(self) -> int:
        return 2 * self.micro_batches  # phase * micro_batches + micro_batch

    def virtual_stages(self) -> int:
        return 2 * self.stages

    def virtual_stage(self, phase: int = 0) -> int:
        return self.stage_id if phase == 0 else 2 * self.stages - 1 - self.stage_id

    def owner(self, virtual_stage: int) -> int:
        return min(virtual_stage, 2 * self.stages - 1 - virtual_stage)

    def phase_of(self, virtual_stage: int) -> int:
        return 0 if virtual_stage < self.stages else 1

    def handoff_slot(self, slot: int) -> int:
        return slot + self.micro_batches

    def steps(self) -> Iterator[list[PipeInstruction]]:
        p, r, m = self.stages, self.stage_id, self.micro_batches
        ops = _Ops(self)
        for _ in range(2 * (p - r - 1)):  # phase-0 forwards ahead of the phase-1 work
            yield ops.forward_chunk(0)
        yield ops.recv_forward(0)
        for i in range(r + 1):  # forwards of both phases in turn
            cmds = ops.forward_chunk(0, recv=False, send=False) + ops.recv_forward(0)
            cmds += ops.forward_chunk(1, send=not ops.last or i < r)
            yield cmds + ops.send_forward(0)
        for _ in range(p - r - 1):  # a phase-1 backward, its weights at once, a phase-1 forward
            cmds = ops.backward_chunk(1, split=True) + ops.recv_forward(1) + ops.weight_chunk()
            yield cmds + ops.forward_chunk(1, recv=False)
        for i in range(m - 2 * p + r + 1):  # the steady state: F0 B1, then F1 B0
            if i == 0 and ops.last:
                cmds = ops.forward_chunk(0, recv=False, send=False) + ops.send_forward(1)
                cmds += ops.backward_chunk(1, send=False) + ops.send_forward(0) + ops.send_backward(1)
            else:
                cmds = ops.forward_backward_chunk(0, 1, recv_forward=i > 0)
            yield cmds + ops.forward_backward_chunk(1, 0)
        for _ in range(p - r - 1):
            yield ops.backward_chunk(1) + ops.forward_backward_chunk(1, 0)
        for i in range(r + 1):  # the cool-down: its second half defers weights
            yield ops.backward_chunk(1, split=2 * i >= r + 1) + ops.backward_chunk(0, split=2 * i + 1 >= r + 1)
        for _ in range(p - r - 1):
            yield ops.weight_chunk() + ops.backward_chunk(0, split=True)
        for _ in range(r + 1):
            yield ops.weight_chunk()
        yield [CommitP2P()] + ([] if self.forward_only else [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()])


class _Ops:
    """The instructions of one rank's DualPipeV stream, each numbered in its phase as DeepSpeed numbers them: the
    n-th forward, backward, send or receive of a phase works on micro-batch n of it."""

    def __init__(self, schedule: DualPipeVSchedule):
        self.schedule = schedule
        self.first, self.last = schedule.stage_id == 0, schedule.stage_id == schedule.stages - 1
        self.counts: dict[tuple[str, int], int] = {}
        self.deferred: deque = deque()  # the slots whose weight pass is still to run, oldest first

    def _slot(self, what: str, phase: int) -> int:
        count = self.counts.get((what, phase), 0)
        self.counts[what, phase] = count + 1
        return phase * self.schedule.micro_batches + count

    def _ends(self, phase: int, outgoing: bool) -> bool:
        """Whether this rank's ``phase`` ends the way a message would leave (``outgoing``) or arrive: the model's
        two ends (rank 0's data and loss) and the turn on the last rank exchange nothing."""
        if outgoing:
            return (self.first and phase == 1) or (self.last and phase == 0)
        return (self.first and phase == 0) or (self.last and phase == 1)

    def recv_forward(self, phase: int) -> list:
        return [] if self._ends(phase, outgoing=False) else [RecvActivation(self._slot("recv_f", phase), phase=phase)]

    def send_forward(self, phase: int) -> list:
        return [] if self._ends(phase, outgoing=True) else [SendActivation(self._slot("send_f", phase), phase=phase)]

    def recv_backward(self, phase: int) -> list:
        if self.schedule.forward_only or self._ends(phase, outgoing=True):
            return []
        return [RecvGrad(self._slot("recv_b", phase), phase=phase)]

    def send_backward(self, phase: int) -> list:
        if self.schedule.forward_only or self._ends(phase, outgoing=False):
            return []
        return [SendGrad(self._slot("send_b", phase), phase=phase)]

    def forward(self, phase: int) -> list:
        slot = self._slot("forward", phase)
        return ([LoadMicroBatch(slot)] if self.first and phase == 0 else []) + [ForwardPass(slot, phase=phase)]

    def backward(self, phase: int, split: bool) -> list:
        if self.schedule.forward_only:
            return []
        slot = self._slot("backward", phase)
        if not (split and self.schedule.split_backward):
            return [BackwardPass(slot, phase=phase)]
        self.deferred.append((slot, phase))
        return [BackwardInputPass(slot, phase=phase)]

    def weight_chunk(self) -> list:
        if self.schedule.forward_only:
            return []
        if not self.schedule.split_backward:
            return [CommitP2P()]
        slot, phase = self.deferred.popleft()
        return [CommitP2P(), BackwardWeightPass(slot, phase=phase)]

    def forward_chunk(self, phase: int, recv: bool = True, send: bool = True) -> list:
        cmds = self.recv_forward(phase) if recv else []
        return cmds + [CommitP2P()] + self.forward(phase) + (self.send_forward(phase) if send else [])

    def backward_chunk(self, phase: int, send: bool = True, split: bool = False) -> list:
        cmds = self.recv_backward(phase) + [CommitP2P()] + self.backward(phase, split)
        return cmds + (self.send_backward(phase) if send else [])

    def forward_backward_chunk(self, forward: int, backward: int, recv_forward: bool = True) -> list:
        cmds = (self.recv_forward(forward) if recv_forward else []) + self.recv_backward(backward)
        cmds += [CommitP2P()] + self.forward(forward) + self.backward(backward, split=False)
        return cmds + self.send_forward(forward) + self.send_backward(backward)
