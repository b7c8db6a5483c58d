"""What each pipeline instruction does, by DeepSpeed's names: the ``_exec_*`` methods and the
``PipelineEngine._INSTRUCTION_MAP`` that maps each instruction class to one, through which the engine runs every
instruction of a schedule (so a client's replacement of an entry is what runs: diffusion-pipe's ``ReduceGrads``), and
the check on paper every stage of a schedule gets before it first runs. A base class of
:class:`~zeroshard.runtime.pipeline_engine.PipelineEngine`; the slots the instructions work on are the batch's
(``pipeline_batch.py``)."""

from __future__ import annotations

import copy
import types
from typing import Iterator

import torch

from .. import comm
from ..pipe import PipelineError
from ..pipe.dualpipev import DualPipeVSchedule
from ..pipe.instructions import (
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
from ..pipe.interleaved import Interleaved1F1BSchedule
from ..pipe.schedule import DataParallelSchedule, InferenceSchedule, PipeSchedule, TrainSchedule
from ..pipe.simulate import ScheduleError, instructions_of, simulate
from ..pipe.zero_bubble import ZeroBubbleH1Schedule

# zeroshard's schedules as defined here (a client replacing ``steps`` makes its schedule a client's)
BUILT_IN = {
    kind: kind.steps
    for kind in (
        TrainSchedule,
        InferenceSchedule,
        DataParallelSchedule,
        ZeroBubbleH1Schedule,
        DualPipeVSchedule,
        Interleaved1F1BSchedule,
    )
}


class InstructionRunner:
    """See the module."""

    def _instructions(self, schedule: PipeSchedule) -> Iterator[PipeInstruction]:
        """This stage's instructions of ``schedule``, as it yields them. A schedule of a client's (a subclass, or
        ``TrainSchedule.steps`` replaced) not run before is first run on paper for every stage
        (``zeroshard.pipe.simulate``): one that would deadlock or mix micro-batches up is refused before anything
        runs. zeroshard's own (``BUILT_IN``) are checked so by the tests, for 1-8 stages and 1-16 micro-batches."""
        kind = type(schedule)
        key = (kind, kind.steps, schedule.micro_batches, schedule.stages, torch.is_grad_enabled())
        if BUILT_IN.get(kind) is not kind.steps and key not in self._checked_schedules:
            try:
                simulate(lambda stage: _at_stage(schedule, stage), schedule.stages, key[-1])
            except ScheduleError as error:
                raise PipelineError(f"rank {comm.get_rank()}: {kind.__name__} cannot run: {error}") from None
            self._checked_schedules.add(key)
        return (instruction for _, instruction in instructions_of(schedule))

    def _exec(self, instruction: PipeInstruction) -> None:
        """Run ``instruction`` through ``_INSTRUCTION_MAP`` (the class's, so a client's entry is the one that runs),
        as DeepSpeed's engine does."""
        function = self._INSTRUCTION_MAP.get(type(instruction))
        if function is None:
            raise PipelineError(
                f"rank {comm.get_rank()}: no entry in PipelineEngine._INSTRUCTION_MAP runs {instruction!r}"
            )
        types.MethodType(function, self)(**instruction.kwargs)

    # DeepSpeed's names for what each instruction does (clients' subclasses call them through super()); ``phase``:
    # the rank's chunk of the model (DualPipeV's instructions name it)
    def _exec_load_micro_batch(self, buffer_id: int) -> None:
        self._batch.load(buffer_id)

    def _exec_forward_pass(self, buffer_id: int, phase: int = 0) -> None:
        self._batch.forward(buffer_id, phase)

    def _exec_backward_pass(self, buffer_id: int, phase: int = 0) -> None:
        self._batch.backward(buffer_id, phase)

    def _exec_backward_input_pass(self, buffer_id: int, phase: int = 0) -> None:
        self._batch.backward_input(buffer_id, phase)

    def _exec_backward_weight_pass(self, buffer_id: int, phase: int = 0) -> None:
        self._batch.backward_weight(buffer_id, phase)

    def _exec_send_activations(self, buffer_id: int, phase: int = 0) -> None:
        self._batch.send_activations(buffer_id, phase)

    def _exec_recv_activations(self, buffer_id: int, phase: int = 0) -> None:
        self._batch.receive_activations(buffer_id, phase)

    def _exec_send_grads(self, buffer_id: int, phase: int = 0) -> None:
        self._batch.send_gradients(buffer_id, phase)

    def _exec_recv_grads(self, buffer_id: int, phase: int = 0) -> None:
        self._batch.receive_gradients(buffer_id, phase)

    def _exec_commit_p2p(self) -> None:
        """Sends left and receives waited when their instructions ran (``CommitP2P``'s docstring)."""

    def _exec_reduce_grads(self) -> None:
        self._batch.finish_reductions()

    def _exec_reduce_tied_grads(self) -> None:
        self._batch.finish_reductions()
        self.stack.sum_tied_gradients()

    def _exec_optimizer_step(self) -> None:
        self._batch.finish_reductions()
        self._optimizer_step()

    _INSTRUCTION_MAP = {
        LoadMicroBatch: _exec_load_micro_batch,
        ForwardPass: _exec_forward_pass,
        BackwardPass: _exec_backward_pass,
        BackwardInputPass: _exec_backward_input_pass,
        BackwardWeightPass: _exec_backward_weight_pass,
        SendActivation: _exec_send_activations,
        RecvActivation: _exec_recv_activations,
        SendGrad: _exec_send_grads,
        RecvGrad: _exec_recv_grads,
        ReduceGrads: _exec_reduce_grads,
        ReduceTiedGrads: _exec_reduce_tied_grads,
        OptimizerStep: _exec_optimizer_step,
        CommitP2P: _exec_commit_p2p,
    }


def _at_stage(schedule: PipeSchedule, stage: int) -> PipeSchedule:
    """``schedule`` as another stage would build it: the same arguments (a client's own too), another ``stage_id``."""
    other = copy.copy(schedule)
    other.stage_id, other.prev_stage, other.next_stage = stage, stage - 1, stage + 1
    return other
