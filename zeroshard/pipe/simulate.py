"""Every stage of a pipeline schedule run together on paper, pure: the check the engine makes before it runs a
schedule it has not run before (a client's ``TrainSchedule.steps`` of its own included), and the tests' proof that
no schedule deadlocks.

The model is the engine's: a send puts its micro-batch on the channel to its neighbour and goes on; a receive waits
until the channel has one, first in first out; everything else runs at once. Each stage's slots are followed: what
micro-batch each holds as inputs, labels, outputs, output gradients and input gradients, so a slot read before it
is written, one overwritten while still needed, or a last stage pairing one micro-batch's activations with another's
labels is an error naming the stage, the step and the instruction. When no stage can move and some have not
finished, the schedule deadlocks: the error names what each stuck stage waits for.

A rank may run several chunks of the model (virtual stages; an instruction's ``phase`` names which, the schedule says
where each runs: DualPipeV's two per rank). Channels join virtual stages; where the next virtual stage runs on the
same rank, a forward's output becomes its input there and its input gradients the output gradients here, with no
exchange.

Each stage also keeps a clock: a forward takes one unit, a backward two, its halves (``BackwardInputPass``,
``BackwardWeightPass``) one each; a send carries the sender's time, a receive waits for it. Each trace's ``busy`` and
``finished`` give the schedule's own bubble on that clock (:func:`bubbles`): 1F1B's ``(p - 1) / (m + p - 1)``,
ZB-H1's ``(p - 1) / (3m + p - 1)``, DualPipeV's, where stages of equal cost wait only for one another."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

from .instructions import (
    BATCH_END,
    BackwardInputPass,
    BackwardPass,
    BackwardWeightPass,
    BufferOpInstruction,
    ForwardPass,
    PipeInstruction,
    RecvActivation,
    RecvGrad,
)
from .schedule import PipeSchedule


class ScheduleError(ValueError):
    """A schedule that would deadlock, or read or overwrite a slot out of turn."""


UNIT_COSTS = {ForwardPass: 1.0, BackwardPass: 2.0, BackwardInputPass: 1.0, BackwardWeightPass: 1.0}


@dataclass
class StageTrace:
    """What one stage did: the micro-batches it ran forward and backward, in order (each once per chunk it runs),
    and the most it held at once (forwards run whose backward had not, over its chunks; in evaluation, 1)."""

    forwards: list[int] = field(default_factory=list)
    backwards: list[int] = field(default_factory=list)
    peak_in_flight: int = 0
    busy: float = 0.0  # units of work on the module's clock
    finished: float = 0.0  # when its last instruction ended


def bubbles(traces: list[StageTrace]) -> list[float]:
    """Each stage's idle fraction of the whole step on the module's clock (from 0 to the last stage's end)."""
    span = max(trace.finished for trace in traces)
    return [1.0 - trace.busy / span for trace in traces]


@dataclass
class _Slots:
    inputs: dict = field(default_factory=dict)
    labels: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)
    sent: dict = field(default_factory=dict)
    output_grads: dict = field(default_factory=dict)
    input_grads: dict = field(default_factory=dict)
    weights_pending: dict = field(default_factory=dict)  # after BackwardInputPass, before BackwardWeightPass
    handed: dict = field(default_factory=dict)  # a slot of the next chunk on this rank -> the slot it came from


def instructions_of(schedule: PipeSchedule) -> Iterator[tuple[int, PipeInstruction]]:
    """(step, instruction) of ``schedule`` in the order they run, produced as the schedule yields them (a batch of
    a million micro-batches is never listed); each checked to be an instruction, the batch's end last."""
    ended = None
    for step, cmds in enumerate(schedule.steps()):
        if not isinstance(cmds, (list, tuple)):
            raise ScheduleError(f"{type(schedule).__name__}: step {step} yielded {type(cmds).__name__}, not a list")
        for cmd in cmds:
            if not isinstance(cmd, PipeInstruction):
                raise ScheduleError(f"{type(schedule).__name__}: step {step} holds {cmd!r}, not a pipeline instruction")
            if isinstance(cmd, BATCH_END):
                ended = ended or (step, cmd)
            elif ended is not None:
                raise ScheduleError(
                    f"{type(schedule).__name__} (stage {schedule.stage_id}): {cmd!r} at step {step} comes after "
                    f"{ended[1]!r} (step {ended[0]}); reductions and the optimizer step end the batch"
                )
            yield step, cmd


def simulate(make: Callable[[int], PipeSchedule], stages: int, training: bool) -> list[StageTrace]:
    """Run the schedules ``make(stage)`` of every stage together (the module's docstring); returns each stage's
    trace, or raises :class:`ScheduleError`."""
    schedules = [make(stage) for stage in range(stages)]
    programs = [list(instructions_of(schedule)) for schedule in schedules]
    micro_batches = schedules[0].micro_batches
    channels: dict[tuple, deque] = {}
    runs = [_StageRun(schedule, training, channels) for schedule in schedules]
    at = [0] * stages
    while any(at[s] < len(programs[s]) for s in range(stages)):
        moved = False
        for s, program in enumerate(programs):
            while at[s] < len(program) and runs[s].do(*program[at[s]]):
                at[s] += 1
                moved = True
        if not moved:
            stuck = [f"stage {s} at step {programs[s][at[s]][0]}: {programs[s][at[s]][1]!r}" for s in range(stages)
                     if at[s] < len(programs[s])]  # fmt: skip
            raise ScheduleError(f"the schedule deadlocks: every unfinished stage waits ({'; '.join(stuck)})")
    left = {key: list(queue) for key, queue in channels.items() if queue}
    if left:
        raise ScheduleError(f"the schedule sends what is never received: {left}")
    for run in runs:
        run.check_complete(micro_batches)
    return [run.trace for run in runs]


class _StageRun:
    def __init__(self, schedule: PipeSchedule, training: bool, channels: dict):
        self.schedule, self.training, self.channels = schedule, training, channels
        self.stage, self.stages = schedule.stage_id, schedule.virtual_stages()
        self.reads_inputs, self.reads_labels = schedule.runs(0), schedule.runs(self.stages - 1)
        self.slots, self.trace = _Slots(), StageTrace()
        self.loaded = 0
        self.in_flight = 0

    def do(self, step: int, cmd: PipeInstruction) -> bool:
        """Run ``cmd``; False when it is a receive with nothing to receive yet."""
        if not isinstance(cmd, BufferOpInstruction):
            return True
        cost = UNIT_COSTS.get(type(cmd), 0.0)
        self.trace.busy += cost
        self.trace.finished += cost
        self.where = f"stage {self.stage}, step {step}, {cmd!r}"
        self.virtual = self.schedule.virtual_stage(cmd.kwargs.get("phase", 0))
        self.first, self.last = self.virtual == 0, self.virtual == self.stages - 1
        slot = cmd.buffer_id
        if isinstance(cmd, (RecvActivation, RecvGrad)):
            peer = self.virtual - 1 if isinstance(cmd, RecvActivation) else self.virtual + 1
            self._neighbour(peer)
            queue = self.channels.get((peer, self.virtual, type(cmd)))
            if not queue:
                return False
            micro, sent_at = queue.popleft()
            self.trace.finished = max(self.trace.finished, sent_at)
            if isinstance(cmd, RecvActivation):
                self._write(self.slots.inputs, slot, micro, "inputs")
            else:
                self._expect(self.slots.sent, slot, micro, "the activations sent")
                self._write(self.slots.output_grads, slot, micro, "output gradients")
            return True
        getattr(self, type(cmd).__name__, self._unknown)(slot)
        return True

    def LoadMicroBatch(self, slot: int) -> None:
        if not (self.reads_inputs or self.reads_labels):
            raise ScheduleError(f"{self.where}: only the first and last stages read data")
        micro, self.loaded = self.loaded, self.loaded + 1
        if self.reads_inputs:
            self._write(self.slots.inputs, slot, micro, "inputs")
        if self.reads_labels:
            self._write(self.slots.labels, self.schedule.labels_slot(slot), micro, "labels")

    def ForwardPass(self, slot: int) -> None:
        micro = self._read(self.slots.inputs, slot, "inputs")
        if self.last:
            self._expect(self.slots.labels, slot, micro, "labels")
            del self.slots.labels[slot]
        if not self.training:
            del self.slots.inputs[slot]
        self._write(self.slots.outputs, slot, micro, "outputs")
        if not self.training and self.last:
            del self.slots.outputs[slot]  # the loss, kept by the engine as a result
        elif self.schedule.runs(self.virtual + 1):  # the next chunk runs here: its input, as if sent and received
            handed = self.schedule.handoff_slot(slot)
            self._write(self.slots.inputs, handed, micro, "inputs")
            del self.slots.outputs[slot]
            if self.training:
                self._write(self.slots.sent, slot, micro, "the activations sent")
                self.slots.handed[handed] = slot
        self.trace.forwards.append(micro)
        self.in_flight += 1 if self.training else 0
        self.trace.peak_in_flight = max(self.trace.peak_in_flight, self.in_flight if self.training else 1)

    def SendActivation(self, slot: int) -> None:
        self._neighbour(self.virtual + 1)
        micro = self._read(self.slots.outputs, slot, "outputs")
        self.channels.setdefault((self.virtual, self.virtual + 1, RecvActivation), deque()).append(
            (micro, self.trace.finished)
        )
        del self.slots.outputs[slot]
        if self.training:
            self._write(self.slots.sent, slot, micro, "the activations sent")

    def BackwardPass(self, slot: int) -> None:
        self._backward(slot)
        self.in_flight -= 1

    def BackwardInputPass(self, slot: int) -> None:
        micro = self._backward(slot)
        self._write(self.slots.weights_pending, slot, micro, "weight gradients still to compute")

    def BackwardWeightPass(self, slot: int) -> None:
        self._read(self.slots.weights_pending, slot, "weight gradients still to compute (BackwardInputPass first)")
        del self.slots.weights_pending[slot]
        self.in_flight -= 1

    def _backward(self, slot: int) -> int:
        if not self.training:
            raise ScheduleError(f"{self.where}: a backward in an evaluation schedule")
        if self.last:
            micro = self._read(self.slots.outputs, slot, "the loss")
            del self.slots.outputs[slot]
        else:
            micro = self._read(self.slots.output_grads, slot, "output gradients")
            del self.slots.output_grads[slot], self.slots.sent[slot]
        if self.first:
            del self.slots.inputs[slot]  # nothing goes back from the first stage
        elif self.schedule.runs(self.virtual - 1):  # the previous chunk runs here: its output gradients
            del self.slots.inputs[slot]
            self._write(self.slots.output_grads, self.slots.handed.pop(slot), micro, "output gradients")
        else:
            self._write(self.slots.input_grads, slot, micro, "input gradients")
        self.trace.backwards.append(micro)
        return micro

    def SendGrad(self, slot: int) -> None:
        self._neighbour(self.virtual - 1)
        micro = self._read(self.slots.input_grads, slot, "input gradients")
        self._expect(self.slots.inputs, slot, micro, "inputs")
        del self.slots.input_grads[slot], self.slots.inputs[slot]
        self.channels.setdefault((self.virtual, self.virtual - 1, RecvGrad), deque()).append(
            (micro, self.trace.finished)
        )

    def _unknown(self, slot: int) -> None:
        raise ScheduleError(f"{self.where}: an instruction the simulation does not know")

    def check_complete(self, micro_batches: int) -> None:
        self.where = f"stage {self.stage} at the end"
        expected = sorted(list(range(micro_batches)) * (self.stages // self.schedule.stages))  # once per chunk
        if sorted(self.trace.forwards) != expected or (self.training and sorted(self.trace.backwards) != expected):
            raise ScheduleError(
                f"{self.where}: each of the {micro_batches} micro-batches runs forward"
                + (" and backward" if self.training else "")
                + f" once; ran forwards {self.trace.forwards}, backwards {self.trace.backwards}"
            )
        held = {name: dict(v) for name, v in vars(self.slots).items() if v}
        if held:
            raise ScheduleError(f"{self.where}: slots still hold {held}")

    def _neighbour(self, peer: int) -> None:
        if not 0 <= peer < self.stages:
            raise ScheduleError(f"{self.where}: there is no stage {peer} to exchange with")
        if self.schedule.runs(peer):
            raise ScheduleError(f"{self.where}: stage {peer} runs on this rank; nothing is exchanged with it")

    def _read(self, slots: dict, slot: int, what: str) -> int:
        if slot not in slots:
            raise ScheduleError(f"{self.where}: slot {slot} holds no {what}")
        return slots[slot]

    def _expect(self, slots: dict, slot: int, micro: int, what: str) -> None:
        held: Optional[int] = slots.get(slot)
        if held != micro:
            raise ScheduleError(f"{self.where}: slot {slot} holds the {what} of micro-batch {held}, not of {micro}")

    def _write(self, slots: dict, slot: int, micro: int, what: str) -> None:
        if slot in slots:
            raise ScheduleError(
                f"{self.where}: slot {slot} still holds the {what} of micro-batch {slots[slot]} (writing {micro})"
            )
        slots[slot] = micro
