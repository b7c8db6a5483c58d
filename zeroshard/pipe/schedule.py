"""The order each pipeline stage runs its work in, pure: DeepSpeed's schedules, by their names and their private
helpers, since clients subclass them and replace ``TrainSchedule.steps`` with their own (diffusion-pipe loads each
micro-batch before exchanging, to broadcast its targets from the first stage to the last).

A schedule is built for one stage (``micro_batches``, ``stages``, ``stage_id``); ``steps()`` yields a list of
instructions (``zeroshard.pipe.instructions``) per step, and a micro-batch in flight lives in a slot of the stage's
buffers (``_buffer_idx``, ``num_pipe_buffers``). The engine runs every step's instructions in order; sends do not
wait for the receiver, receives do. :mod:`zeroshard.pipe.simulate` runs all stages of a schedule that way and names
a receive that would wait for ever, a slot read before it was written or a label paired with another micro-batch's
activations; the engine checks a schedule so before running it.

- :class:`TrainSchedule`: one forward, one backward (1F1B), DeepSpeed's lockstep order: step ``t`` of stage ``s`` is
  a forward when ``t`` and ``s`` have the same parity. Stage ``s`` of ``p`` holds at most ``min(p - s, m)``
  micro-batches' activations (GPipe holds ``m``); the idle fraction of each stage, its bubble, is ``(p - 1) / (m +
  p - 1)`` when every stage takes the same time.
- :class:`InferenceSchedule`: forwards only, two slots.
- :class:`DataParallelSchedule`: one stage, forward and backward per micro-batch (DeepSpeed's example).
"""

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


class PipeSchedule:
    """The instructions of stage ``stage_id`` of ``stages`` over a batch of ``micro_batches``; subclasses define
    :meth:`steps` (and :meth:`num_pipe_buffers` when they keep fewer slots than micro-batches)."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int):
        for name, value, low in (("stages", stages, 1), ("micro_batches", micro_batches, 1), ("stage_id", stage_id, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"pipeline schedule: {name} must be an int >= {low}, got {value!r}")
        if stage_id >= stages:
            raise ValueError(f"pipeline schedule: stage {stage_id} of {stages} stages does not exist")
        self.micro_batches, self.stages, self.stage_id = micro_batches, stages, stage_id
        self.prev_stage, self.next_stage = stage_id - 1, stage_id + 1

    def steps(self) -> Iterator[list[PipeInstruction]]:
        raise NotImplementedError(f"{type(self).__name__}.steps(): a schedule yields a list of instructions per step")

    # Where the model's chunks (virtual stages) run: here one per rank, stage s on rank s; DualPipeV's two per rank
    # (``zeroshard.pipe.dualpipev``). An instruction's ``phase`` (0 when it names none) is the rank's chunk it runs.
    def virtual_stages(self) -> int:
        return self.stages

    def virtual_stage(self, phase: int = 0) -> int:
        """The virtual stage this rank runs in ``phase``."""
        return self.stage_id

    def owner(self, virtual_stage: int) -> int:
        """The rank that runs ``virtual_stage``."""
        return virtual_stage

    def phase_of(self, virtual_stage: int) -> int:
        """The phase in which its rank runs ``virtual_stage``."""
        return 0

    def runs(self, virtual_stage: int) -> bool:
        """Whether this rank runs ``virtual_stage`` (one of the model's stages; False off the model's ends)."""
        return 0 <= virtual_stage < self.virtual_stages() and self.owner(virtual_stage) == self.stage_id

    def labels_slot(self, slot: int) -> int:
        """Where ``LoadMicroBatch(slot)`` puts the labels: the same slot, or on a rank that also reads the inputs in
        another of its stages (DualPipeV's rank 0) the micro-batch's slot in its next stage, the loss's."""
        return self.handoff_slot(slot) if self.runs(0) and self.virtual_stages() > self.stages else slot

    def handoff_slot(self, slot: int) -> int:
        """Where a micro-batch in ``slot`` of this rank's chunk lives in the rank's next chunk, when the model passes
        from one to the other on this rank (no exchange: DualPipeV's turn on the last rank)."""
        return slot

    def num_pipe_buffers(self) -> int:
        return self.micro_batches

    def _valid_micro_batch(self, micro_batch_id: int) -> bool:
        return 0 <= micro_batch_id < self.micro_batches

    def _valid_stage(self, stage_id: int) -> bool:
        return 0 <= stage_id < self.stages

    def _buffer_idx(self, micro_batch_id: int) -> int:
        """The slot of micro-batch ``micro_batch_id``: slots are reused in turn."""
        if not self._valid_micro_batch(micro_batch_id):
            raise ValueError(f"micro-batch {micro_batch_id} is not one of this batch's {self.micro_batches}")
        return micro_batch_id % self.num_pipe_buffers()

    @property
    def stage(self) -> int:
        return self.stage_id

    @property
    def num_stages(self) -> int:
        return self.stages

    @property
    def num_micro_batches(self) -> int:
        return self.micro_batches

    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.stages - 1

    def __iter__(self):
        self.it = None
        return self

    def __next__(self) -> list[PipeInstruction]:
        if self.it is None:
            self.it = self.steps()
        return next(self.it)


class TrainSchedule(PipeSchedule):
    """1F1B in DeepSpeed's lockstep order (the module's docstring). At each step a stage first exchanges (a forward
    step sends the previous micro-batch's input gradients and receives this one's activations; a backward step
    receives this micro-batch's output gradients and sends the previous one's activations), then the first and last
    stages load a forward's micro-batch, then it computes; the last step reduces and steps."""

    def steps(self) -> Iterator[list[PipeInstruction]]:
        previous = -1
        total = 2 * (self.micro_batches + self.stages - 1)
        for step_id in range(total):
            micro, forward = self._step_to_micro_batch(step_id)
            valid, previous_valid = self._valid_micro_batch(micro), self._valid_micro_batch(previous)
            cmds: list[PipeInstruction] = []
            if forward:
                if previous_valid and self._valid_stage(self.prev_stage):
                    cmds.append(SendGrad(self._buffer_idx(previous)))
                if valid and self._valid_stage(self.prev_stage):
                    cmds.append(RecvActivation(self._buffer_idx(micro)))
            else:
                if valid and self._valid_stage(self.next_stage):
                    cmds.append(RecvGrad(self._buffer_idx(micro)))
                if previous_valid and self._valid_stage(self.next_stage):
                    cmds.append(SendActivation(self._buffer_idx(previous)))
            if forward and valid and (self.is_first_stage or self.is_last_stage):
                cmds.append(LoadMicroBatch(self._buffer_idx(micro)))
            if valid:
                cmds.append((ForwardPass if forward else BackwardPass)(self._buffer_idx(micro)))
            if step_id == total - 1:
                cmds += [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
            previous = micro
            yield cmds

    def num_pipe_buffers(self) -> int:
        """The most micro-batches in flight on this stage: the warm-up's forwards and the one being drained."""
        return max(2, min(self.stages - self.stage_id, self.micro_batches))

    def _step_to_micro_batch(self, step_id: int) -> tuple[int, bool]:
        """(micro-batch, is forward) of step ``step_id``: stages of one parity run forwards on even steps and
        backwards on odd ones, the others the other way; a stage starts its forwards ``stage_id // 2`` double steps
        late and its backwards when the last stage's first gradient has come back to it (out-of-range ids: idle)."""
        forward = step_id % 2 == self.stage_id % 2
        if forward:
            return step_id // 2 - self.stage_id // 2, True
        return step_id // 2 - self.stages + self.stage_id // 2 + 1, False


class InferenceSchedule(PipeSchedule):
    """Forwards only, micro-batch ``t - stage_id`` at step ``t``, alternating between two slots: even stages send
    the previous output before receiving the next input, odd stages the other way round."""

    def steps(self) -> Iterator[list[PipeInstruction]]:
        for step_id in range(self.micro_batches + self.stages - 1):
            micro = step_id - self.stage_id
            even = self.stage_id % 2 == 0
            receive_slot, send_slot = (step_id % 2, (step_id + 1) % 2) if even else ((step_id + 1) % 2, step_id % 2)
            cmds: list[PipeInstruction] = []
            if (self.is_first_stage or self.is_last_stage) and self._valid_micro_batch(micro):
                cmds.append(LoadMicroBatch(receive_slot))
            send = self._valid_stage(self.next_stage) and self._valid_micro_batch(micro - 1)
            receive = self._valid_stage(self.prev_stage) and self._valid_micro_batch(micro)
            exchange = [SendActivation(send_slot)] * send + [RecvActivation(receive_slot)] * receive
            cmds += exchange if even else exchange[::-1]
            if self._valid_micro_batch(micro):
                cmds.append(ForwardPass(receive_slot))
            yield cmds

    def num_pipe_buffers(self) -> int:
        return 2


class DataParallelSchedule(PipeSchedule):
    """One stage: load, forward and backward each micro-batch in one slot, then reduce and step."""

    def steps(self) -> Iterator[list[PipeInstruction]]:
        for step_id in range(self.micro_batches):
            cmds: list[PipeInstruction] = [LoadMicroBatch(0), ForwardPass(0), BackwardPass(0)]
            if step_id == self.micro_batches - 1:
                cmds += [ReduceGrads(), OptimizerStep()]
            yield cmds

    def num_pipe_buffers(self) -> int:
        return 1
