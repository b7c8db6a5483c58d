"""One batch of one pipeline stage: the slots holding its micro-batches in flight (inputs, labels, outputs kept for
backward, what was announced when they were sent, the gradients received for them) and what each instruction of a
schedule does to them. The engine (``zeroshard.runtime.pipeline_engine``) runs a schedule's instructions through
its ``_INSTRUCTION_MAP``, whose entries call these.

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
from .activation_checkpointing import in_effect as checkpointing_in_effect
from .split_backward import WeightWork, backward_input

if TYPE_CHECKING:
    from .pipeline_engine import PipelineEngine


class PipelineBatch:
    """The slots of one batch on one stage (see the module); ``results``: the last stage's per-micro-batch losses
    (or outputs) in the order they were computed."""

    def __init__(self, engine: PipelineEngine, compute_loss: bool, scalar: bool, micro_batches: int):
        self.engine, self.compute_loss, self.scalar = engine, compute_loss, scalar
        self.micro_batches = micro_batches
        self.inputs: dict[int, Any] = {}
        self.labels: dict[int, Any] = {}
        self.outputs: dict[int, Any] = {}
        self.sent: dict[int, Announcement] = {}
        self.received: dict[int, list] = {}
        self.results: list = []
        self.loaded = self.backwards = self.weights_done = 0
        self.weight_work: dict[int, WeightWork] = {}  # slot -> what its W still has to do (zero-bubble schedules)
        self.in_flight = self.peak_in_flight = 0  # micro-batches whose forward ran and backward has not
        self.reductions_pending = False  # the last backward launched reductions nobody has waited for yet
        self.activations_sent = self.gradients_sent = 0

    def brings_last_gradients(self, instruction: PipeInstruction) -> bool:
        """Whether ``instruction`` is the backward that brings the batch's last weight gradients (and launches the
        reductions): the last ``BackwardPass``, or a zero-bubble schedule's last ``BackwardWeightPass``."""
        if isinstance(instruction, BackwardPass):
            return self.backwards == self.micro_batches - 1
        return isinstance(instruction, BackwardWeightPass) and self.weights_done == self.micro_batches - 1

    def owes(self, first: bool, last: bool) -> tuple[bool, bool]:
        """Whether this stage still owes the next stage activations, and the previous one gradients (every
        schedule sends each micro-batch's once: zeroshard's by construction, a client's checked on paper)."""
        training = torch.is_grad_enabled()
        return (not last and self.activations_sent < self.micro_batches,
                training and not first and self.gradients_sent < self.micro_batches)  # fmt: skip

    def load(self, slot: int) -> None:
        engine = self.engine
        inputs, labels = engine._next_batch(self.loaded, self.micro_batches)
        self.loaded += 1
        if engine.is_first_stage():
            self.inputs[slot] = tree_map(
                lambda t: t.detach().to(engine.device) if torch.is_tensor(t) else t,
                tuple(inputs) if isinstance(inputs, list) else inputs,
            )
        if engine.is_last_stage():
            self.labels[slot] = tree_map(lambda t: t.to(engine.device) if torch.is_tensor(t) else t, labels)

    def receive_activations(self, slot: int) -> None:
        self.inputs[slot] = self.engine.exchange.receive_activations()[1]

    def forward(self, slot: int) -> None:
        engine = self.engine
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
        with checkpointing_in_effect(engine.activation_checkpointing):
            output = engine.module(inputs)
        if torch.is_grad_enabled():
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        if not engine.is_last_stage():
            self.outputs[slot] = output
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

    def send_activations(self, slot: int) -> None:
        self.sent[slot] = self.engine.exchange.send_activations(self.outputs[slot])
        self.activations_sent += 1
        if not torch.is_grad_enabled():
            del self.outputs[slot]

    def receive_gradients(self, slot: int) -> None:
        self.received[slot] = self.engine.exchange.receive_gradients(self.sent.pop(slot))

    def backward(self, slot: int) -> None:
        engine, output = self.engine, self.outputs.pop(slot)
        boundary = self.backwards == self.micro_batches - 1
        self.backwards += 1
        self.in_flight -= 1
        if engine.is_first_stage():
            self.inputs.pop(slot, None)  # no gradient goes back from the first stage
        if engine.is_last_stage():  # a one-element loss: forward checked it
            scale = engine.stack.loss_scale / engine.micro_batches  # once, on the last stage only
            tensors, grads = [output.float().reshape(()) * scale], None
        else:
            outputs = [output] if torch.is_tensor(output) else list(output)
            tensors, grads = [t for t in outputs if t.requires_grad], self.received.pop(slot)
            if not tensors:
                return  # nothing before this point trains (a frozen stage)
        self.reductions_pending = boundary
        engine._backward_from(tensors, grads, boundary, finish=not boundary)

    def backward_input(self, slot: int) -> None:
        """B of a zero-bubble schedule: the gradients of the slot's inputs only; the weights' wait for
        :meth:`backward_weight` (``zeroshard.runtime.split_backward``)."""
        engine, output = self.engine, self.outputs.pop(slot)
        self.backwards += 1
        inputs = self.inputs.get(slot)
        inputs = [] if inputs is None else [inputs] if torch.is_tensor(inputs) else list(inputs)
        leaves = [x for x in inputs if torch.is_tensor(x) and x.requires_grad]
        if engine.is_first_stage():
            self.inputs.pop(slot, None)  # no gradient goes back from the first stage
        if engine.is_last_stage():
            tensors, grads = [output.float().reshape(()) * (engine.stack.loss_scale / engine.micro_batches)], None
        else:
            outputs = [output] if torch.is_tensor(output) else list(output)
            tensors, grads = [t for t in outputs if t.requires_grad], self.received.pop(slot)
        engine.stack.refuse_if_offloaded("backward")
        self.weight_work[slot] = backward_input(tensors, grads, leaves) if tensors else WeightWork()

    def backward_weight(self, slot: int) -> None:
        """W: the slot's weight gradients, into the stack's hooks (reduced at the batch's last W)."""
        engine, work = self.engine, self.weight_work.pop(slot)
        boundary = self.weights_done == self.micro_batches - 1
        self.weights_done += 1
        self.in_flight -= 1
        self.reductions_pending = boundary
        engine._backward_with(work.run, boundary, finish=not boundary)

    def send_gradients(self, slot: int) -> None:
        inputs = self.inputs.pop(slot)
        inputs = [inputs] if torch.is_tensor(inputs) else list(inputs)
        grads = [x.grad if x.grad is not None else torch.zeros_like(x) for x in inputs if x.requires_grad]
        self.engine.exchange.send_gradients(grads)
        self.gradients_sent += 1

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
