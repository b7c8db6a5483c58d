"""One batch of one pipeline stage: the slots holding its micro-batches in flight (inputs, labels, outputs kept for
backward, what was announced when they were sent, the gradients received for them) and what each instruction of a
schedule does to them. The engine (``zeroshard.runtime.pipeline_engine``) runs a schedule's instructions through
its ``_INSTRUCTION_MAP``, whose entries call these. An instruction's ``phase`` is the chunk of the model it runs on
(one per rank; DualPipeV's two, interleaved 1F1B's k; the schedule says which): where the model passes between two
chunks of this rank, a forward's output becomes the next chunk's input and a backward's input gradients the previous
chunk's output gradients, with no exchange.

Gradients are reduced over the stage's data-parallel ranks while the batch's last backward runs (bucket by bucket,
as any engine's); waiting for them is left to :class:`~zeroshard.pipe.instructions.ReduceGrads`, so the stage sends
its last input gradients back before it waits, and the stage before starts its last backward that much earlier."""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_map

from .. import comm
from ..pipe import Announcement, PipelineError
from ..pipe.instructions import BackwardPass, BackwardWeightPass, PipeInstruction
from ..pipe.schedule import PipeSchedule
from .activation_checkpointing import in_effect as checkpointing_in_effect
from .split_backward import WeightWork, backward_input

if TYPE_CHECKING:
    from .pipeline_engine import PipelineEngine


class PipelineBatch:
    """The slots of one batch on one stage (see the module); ``results``: the last stage's per-micro-batch losses
    (or outputs) in the order they were computed."""

    def __init__(self, engine: PipelineEngine, compute_loss: bool, scalar: bool, schedule: PipeSchedule):
        self.engine, self.compute_loss, self.scalar, self.schedule = engine, compute_loss, scalar, schedule
        self.micro_batches = schedule.micro_batches
        self.chunks = schedule.virtual_stages() // schedule.stages  # the model's chunks this rank runs
        self.reads_inputs, self.reads_labels = schedule.runs(0), schedule.runs(schedule.virtual_stages() - 1)
        self.inputs: dict[int, Any] = {}
        self.labels: dict[int, Any] = {}
        self.outputs: dict[int, Any] = {}
        self.sent: dict[int, Announcement] = {}
        self.received: dict[int, list] = {}
        self.results: list = []
        self.handed: dict[int, int] = {}  # a slot of this rank's next chunk -> the slot of the chunk it came from
        self.loaded = self.backwards = self.gradient_passes = 0
        self.weight_work: dict[int, WeightWork] = {}  # slot -> what its W still has to do (zero-bubble schedules)
        self.in_flight = self.peak_in_flight = 0  # micro-batches (per chunk) whose forward ran and backward has not
        self.reductions_pending = False  # the last backward launched reductions nobody has waited for yet
        self.activations_sent = [0] * self.chunks
        self.gradients_sent = [0] * self.chunks

    def brings_last_gradients(self, instruction: PipeInstruction) -> bool:
        """Whether ``instruction`` is the backward that brings the batch's last weight gradients (and launches the
        reductions): the last ``BackwardPass`` or ``BackwardWeightPass`` (a zero-bubble schedule's) of the batch,
        one per micro-batch and chunk."""
        return (isinstance(instruction, (BackwardPass, BackwardWeightPass))
                and self.gradient_passes == self.micro_batches * self.chunks - 1)  # fmt: skip

    def owes(self, phase: int) -> tuple[bool, bool]:
        """Whether this rank's ``phase`` still owes its next stage activations, and its previous one gradients
        (every schedule sends each micro-batch's once: zeroshard's by construction, a client's checked on paper)."""
        first, last = self._ends(phase)
        training = torch.is_grad_enabled()
        return (not last and not self._here(phase, 1) and self.activations_sent[phase] < self.micro_batches,
                training and not first and not self._here(phase, -1)
                and self.gradients_sent[phase] < self.micro_batches)  # fmt: skip

    def _ends(self, phase: int) -> tuple[bool, bool]:
        """Whether ``phase``'s chunk is the model's first (reads the inputs), and its last (computes the loss)."""
        virtual = self.schedule.virtual_stage(phase)
        return virtual == 0, virtual == self.schedule.virtual_stages() - 1

    def _here(self, phase: int, step: int) -> bool:
        """Whether the chunk ``step`` (1: next, -1: previous) from ``phase``'s runs on this rank too."""
        return self.schedule.runs(self.schedule.virtual_stage(phase) + step)

    def load(self, slot: int) -> None:
        engine = self.engine
        inputs, labels = engine._next_batch(self.loaded, self.micro_batches)
        self.loaded += 1
        if self.reads_inputs:
            self.inputs[slot] = tree_map(
                lambda t: t.detach().to(engine.device) if torch.is_tensor(t) else t,
                tuple(inputs) if isinstance(inputs, list) else inputs,
            )
        if self.reads_labels:
            self.labels[self.schedule.labels_slot(slot)] = tree_map(
                lambda t: t.to(engine.device) if torch.is_tensor(t) else t, labels
            )

    def receive_activations(self, slot: int, phase: int = 0) -> None:
        self.inputs[slot] = self.engine.exchanges[phase].receive_activations()[1]

    def forward(self, slot: int, phase: int = 0) -> None:
        engine, last = self.engine, self._ends(phase)[1]
        if self.chunks > 1:
            engine.module.activate_phase(phase)
        if slot not in self.inputs:
            raise PipelineError(
                f"rank {comm.get_rank()} (pipeline stage {engine.stage_id}): ForwardPass({slot}) before its inputs "
                "were loaded or received (the schedule's order)"
            )
        # a received activation goes in as a copy, as DeepSpeed passes it: a stage may start with an in-place layer
        # (nn.ReLU(inplace=True)), and the received leaf keeps the gradient to send back
        inputs = tree_map(lambda t: t.clone() if torch.is_tensor(t) else t, self.inputs[slot])
        if not torch.is_grad_enabled():
            del self.inputs[slot]
        with checkpointing_in_effect(engine.activation_checkpointing), engine._compiled_observed():
            output = engine.module(inputs)
        if torch.is_grad_enabled():
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        if not last:
            self.outputs[slot] = output
            if self._here(phase, 1):  # the next chunk runs here: its input, as a receive would give it
                handed = self.schedule.handoff_slot(slot)
                self.inputs[handed] = tree_map(
                    lambda t: t.detach().requires_grad_(t.requires_grad) if torch.is_tensor(t) else t, output
                )
                self.handed[handed] = slot
                if not torch.is_grad_enabled():
                    del self.outputs[slot]
            return
        labels = self.labels.pop(slot, None)
        loss_fn = engine.module.loss_fn
        output_or_loss = loss_fn(output, labels) if self.compute_loss and loss_fn is not None else output
        if self.scalar and not (torch.is_tensor(output_or_loss) and output_or_loss.numel() == 1):
            got = tuple(output_or_loss.shape) if torch.is_tensor(output_or_loss) else type(output_or_loss).__name__
            raise PipelineError(
                f"rank {comm.get_rank()}: the last stage's loss must be a one-element tensor, got {got} (set "
                "loss_fn on the PipelineModule, or return the loss from the last layer)"
            )
        if engine._return_logits:
            engine.outputs = output
        if torch.is_grad_enabled():
            self.outputs[slot] = output_or_loss
        self.results.append(output_or_loss.detach() if torch.is_tensor(output_or_loss) else output_or_loss)

    def send_activations(self, slot: int, phase: int = 0) -> None:
        self.sent[slot] = self.engine.exchanges[phase].send_activations(self.outputs[slot])
        self.activations_sent[phase] += 1
        if not torch.is_grad_enabled():
            del self.outputs[slot]

    def receive_gradients(self, slot: int, phase: int = 0) -> None:
        self.received[slot] = self.engine.exchanges[phase].receive_gradients(self.sent.pop(slot))

    def _backward_start(self, slot: int, phase: int) -> tuple[list, Any]:
        """What the slot's backward starts from: the scaled loss on the model's last chunk, else the outputs that
        need a gradient with the gradients received (or handed back) for them."""
        engine, output = self.engine, self.outputs.pop(slot)
        first, last = self._ends(phase)
        self.backwards += 1
        if first:
            self.inputs.pop(slot, None)  # no gradient goes back from the model's first chunk
        if last:  # a one-element loss: forward checked it; scaled once, on the last chunk only
            return [output.float().reshape(()) * (engine.stack.loss_scale / engine.micro_batches)], None
        outputs = [output] if torch.is_tensor(output) else list(output)
        return [t for t in outputs if t.requires_grad], self.received.pop(slot)

    def backward(self, slot: int, phase: int = 0) -> None:
        tensors, grads = self._backward_start(slot, phase)
        boundary = self.gradient_passes == self.micro_batches * self.chunks - 1
        self.gradient_passes += 1
        self.in_flight -= 1
        if tensors:  # else nothing before this point trains (a frozen stage)
            self.reductions_pending = boundary
            self.engine._backward_from(tensors, grads, boundary, finish=not boundary)
        self._hand_back(slot, phase)

    def backward_input(self, slot: int, phase: int = 0) -> None:
        """B of a zero-bubble schedule: the gradients of the slot's inputs only; the weights' wait for
        :meth:`backward_weight` (``zeroshard.runtime.split_backward``)."""
        inputs = self.inputs.get(slot)
        inputs = [] if inputs is None else [inputs] if torch.is_tensor(inputs) else list(inputs)
        leaves = [x for x in inputs if torch.is_tensor(x) and x.requires_grad]
        tensors, grads = self._backward_start(slot, phase)
        self.engine.stack.refuse_if_offloaded("backward")
        self.weight_work[slot] = backward_input(tensors, grads, leaves) if tensors else WeightWork()
        self._hand_back(slot, phase)

    def backward_weight(self, slot: int, phase: int = 0) -> None:
        """W: the slot's weight gradients, into the stack's hooks (reduced at the batch's last gradient pass)."""
        engine, work = self.engine, self.weight_work.pop(slot)
        boundary = self.gradient_passes == self.micro_batches * self.chunks - 1
        self.gradient_passes += 1
        self.in_flight -= 1
        self.reductions_pending = boundary
        engine._backward_with(work.run, boundary, finish=not boundary)

    def _hand_back(self, slot: int, phase: int) -> None:
        """Where the previous chunk runs on this rank, its output gradients are this slot's input gradients."""
        if self._here(phase, -1):
            self.received[self.handed.pop(slot)] = self._input_gradients(slot)

    def _input_gradients(self, slot: int) -> list[torch.Tensor]:
        inputs = self.inputs.pop(slot)
        inputs = [inputs] if torch.is_tensor(inputs) else list(inputs)
        return [x.grad if x.grad is not None else torch.zeros_like(x) for x in inputs if x.requires_grad]

    def send_gradients(self, slot: int, phase: int = 0) -> None:
        self.engine.exchanges[phase].send_gradients(self._input_gradients(slot))
        self.gradients_sent[phase] += 1

    def finish_reductions(self) -> None:
        """Wait for the reductions the last backward launched (once)."""
        if self.reductions_pending:
            self.reductions_pending = False
            started = time.perf_counter()
            self.engine.stack.end_backward()
            self.engine.reporting.timers["reduce_wait"] += time.perf_counter() - started

    def settle_after_failure(self) -> None:
        """The batch failed: the reductions this rank owes the other ranks of its stage (they wait in them) are
        launched and finished; the first error counts, whatever this one does."""
        with contextlib.suppress(Exception):
            self.finish_reductions()
