"""The pipeline engine: DeepSpeed's ``PipelineEngine`` surface (``train_batch``, ``eval_batch``, the grid) over the
engine of one stage.

Each rank runs the stage of a :class:`~zeroshard.pipe.PipelineModule` its pipe coordinate names, through the same
ZeRO stack as any engine, over the ranks of its stage. A batch is ``gradient_accumulation_steps`` micro-batches run
as a schedule orders them (``zeroshard.pipe.schedule``: DeepSpeed's ``TrainSchedule``, 1F1B), instruction by
instruction through ``_INSTRUCTION_MAP`` as DeepSpeed's engine runs them (a client's replacement of an entry, or of
``TrainSchedule.steps``, is what runs; a schedule is first run on paper for every stage, ``zeroshard.pipe.simulate``),
activations and their gradients passed
between neighbours (:mod:`zeroshard.pipe.exchange`). The arithmetic is one model's: the last stage scales each
micro-batch's loss by ``1 / micro-batches`` once, the other stages back-propagate the gradients they receive as
they are (scaling them again was DeepSpeed issue 8152); the gradients are reduced over the data-parallel ranks of
each stage at the last micro-batch, tied parameters summed over the stages holding them, and the gradient norm
taken over all stages (``zeroshard.zero.stack``).

A ``DualPipeVModule`` runs DualPipeV (``zeroshard.pipe.dualpipev``: two stages per rank, rank 0 holding the loss), a
module of ``stages_per_rank`` k > 1 interleaved 1F1B (``zeroshard.pipe.interleaved``); one exchange per stage a rank
runs.

A failure on one rank (a ``loss_fn`` raising, a data iterator running out) stops every rank with a named error: the
failing rank tells its pipeline neighbours (they pass it on), and before the last micro-batch's backward, the one
place gradients are exchanged between pipelines, the ranks of each stage agree on whether any failed.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Iterator, Optional

import torch

from .. import comm
from ..accelerator import get_accelerator
from ..checkpoint.view import PipelinePlacement, TrainingState
from ..pipe import (
    DualPipeVModule,
    PipelineError,
    PipelineGrid,
    PipelineModule,
    StageAborted,
    StageExchange,
)
from ..pipe.dualpipev import DualPipeVSchedule
from ..pipe.exchange import ACTIVATIONS, GRADIENTS, links_of, stop_neighbours
from ..pipe.instructions import BATCH_END
from ..pipe.interleaved import Interleaved1F1BSchedule
from ..pipe.schedule import InferenceSchedule, PipeSchedule, TrainSchedule
from ..pipe.zero_bubble import ZeroBubbleH1Schedule
from .engine import ZeroshardEngine
from .micro_batches import DataExhausted
from .pipeline_batch import PipelineBatch
from .pipeline_checks import check_placed_as_built, check_schedule
from .pipeline_instructions import InstructionRunner
from .sampler import RepeatingLoader

SCHEDULES = {"1f1b": TrainSchedule, "zb-h1": ZeroBubbleH1Schedule}  # pipeline.schedule -> the training schedule


class PipelineDataExhausted(PipelineError, DataExhausted):
    """A data iterator ended (a ``StopIteration`` too, as DeepSpeed's engine lets the iterator's own escape). At a
    batch boundary every rank raises it and the engine goes on with the next iterator, so loops that stop on it
    keep working; inside a batch the rank whose data ended raises it and the batch has failed."""


class PipelineEngine(InstructionRunner, ZeroshardEngine):
    """The engine of one pipeline stage (see the module). ``forward`` / ``backward`` / ``step`` are refused as in
    DeepSpeed: ``train_batch`` runs all three for a whole batch."""

    def __init__(self, module: PipelineModule, *, ties: dict, **kwargs):
        super().__init__(module, **kwargs)
        module: PipelineModule = self.module
        self.num_stages, self.stage_id = self.mesh.pipe.size, self.mesh.pipe.rank
        check_placed_as_built(module, self.mesh)
        self.micro_batches = self.batch.gradient_accumulation_steps
        # the backward split in B and W (zero-bubble schedules) needs each backward's weights whole and no recomputation
        self._split_backward = (
            getattr(self.stack, "stage3", None) is None and module.activation_checkpoint_interval == 0
        )
        check_schedule(self.settings.pipeline.schedule, module, self.stack, self.micro_batches, self.mesh)
        layout = self._train_schedule()  # where the model's stages run (any of this module's schedules says alike)
        self._loss_stage = layout.owner(layout.virtual_stages() - 1)
        self.micro_batch_size = self.batch.micro_batch_size
        self.grid = PipelineGrid(self.mesh, model_axis="model" in module.topology().get_axis_names())
        self.is_pipe_parallel = self.num_stages > 1
        self.is_data_parallel = self.mesh.batch.size > 1
        self.is_model_parallel = self.mesh.tensor.size > 1
        # the exchanges run on a channel derived on the mesh for this engine (the mesh is the engine's), so nothing a
        # failed batch left unreceived reaches another group
        channel = self.mesh.derive("pipe_exchange", self.mesh.dims.derived("pipe"))
        limit = self.settings.pipeline.max_activation_bytes or get_accelerator().total_memory() // 4
        block = self.settings.pipeline  # DeepSpeed's: each tensor-parallel rank sends a slice, the receiver gathers
        slices = {ACTIVATIONS: self.mesh.tensor} if block.pipe_partitioned else {}
        slices.update({GRADIENTS: self.mesh.tensor} if block.grad_partitioned else {})
        self.exchanges = [
            StageExchange(channel, self.stage_id, self.num_stages, self.device, limit, slices, links_of(layout, phase))
            for phase in range(layout.virtual_stages() // self.num_stages)
        ]
        self.exchange = self.exchanges[0]
        self.ties = ties  # tie key -> this rank's tie group (the stages holding the tied module), the mesh's
        self.data_iterator: Optional[Iterator] = None
        self.batch_fn = None
        self.agg_train_loss: Optional[torch.Tensor] = None
        self.outputs = None  # eval_batch(return_logits=True): the last micro-batch's outputs (last stage)
        self._return_logits = False
        self._failed: Optional[str] = None  # a batch failed: the channels are out of step, nothing more runs
        self._stop_words: list = []  # the words that a batch failed, posted to the neighbours (see _stop_batch)
        self._batch: Optional[PipelineBatch] = None  # the batch running, or the last one
        self._checked_schedules: set = set()  # (schedule, its steps, micro-batches, stages, training) run on paper
        self.peak_micro_batches_in_flight = 0  # the last training batch's on this stage (activations kept)
        if self.training_dataloader is not None and (self.is_first_stage() or self.is_last_stage()):
            # initialize(training_data=...): read forever, as DeepSpeed does; the loader (its resumable sampler,
            # which checkpoints save) stays the engine's
            self.data_iterator = RepeatingLoader(self.training_dataloader)

    def _training_state(self) -> TrainingState:
        """A checkpoint holds every stage's parameters under the whole model's names; this stage's are these."""
        module: PipelineModule = self.module
        tied = frozenset(module.tied_modules.keys())
        mirrored = frozenset(
            k for k in tied if self.ties.get(k) is not None and self.ties[k].ranks[0] != comm.get_rank()
        )
        files = tuple(module.layer_state_files())
        layout, phases = self._train_schedule(), module.stages_per_rank
        chunks = tuple(layout.virtual_stage(phase) for phase in range(phases)) if phases > 1 else ()
        placement = PipelinePlacement(
            self.num_stages, tuple(module.parts), self.stage_id, tied, mirrored, files, chunks
        )
        return dataclasses.replace(super()._training_state(), pipeline=placement)

    @property
    def mpu(self) -> PipelineGrid:
        return self.grid

    # -- DeepSpeed's pipeline-engine API ------------------------------------------------------------
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        """Whether this rank computes the loss (and reads the labels): the last stage's, or under DualPipeV rank 0,
        whose second chunk ends the model."""
        return self.stage_id == self._loss_stage

    def _train_schedule(self) -> PipeSchedule:
        return self._schedule(self.micro_batches, training=True)

    def _inference_schedule(self, micro_batches: int) -> PipeSchedule:
        return self._schedule(micro_batches, training=False)

    def _schedule(self, micro_batches: int, training: bool) -> PipeSchedule:
        """This rank's schedule of a batch: the module's (DualPipeV, interleaved 1F1B), else ``pipeline.schedule``'s
        (evaluation: forwards only)."""
        module, stages, stage = self.module, self.num_stages, self.stage_id
        if isinstance(module, DualPipeVModule):
            split = training and self._split_backward
            return DualPipeVSchedule(micro_batches, stages, stage, forward_only=not training, split_backward=split)
        if module.stages_per_rank > 1:
            chunks = module.stages_per_rank
            return Interleaved1F1BSchedule(micro_batches, stages, stage, chunks=chunks, forward_only=not training)
        if not training:
            return InferenceSchedule(micro_batches=micro_batches, stages=stages, stage_id=stage)
        kind = SCHEDULES[self.settings.pipeline.schedule]
        return kind(micro_batches=micro_batches, stages=stages, stage_id=stage)

    def _waited(self) -> float:
        """Seconds this rank has spent in pipeline receives (the bubble, and the transfers)."""
        return sum(exchange.waited for exchange in self.exchanges)

    def get_pipeline_parallel_rank(self) -> int:
        return self.stage_id

    def set_dataloader(self, loader) -> None:
        if self.is_first_stage() or self.is_last_stage():
            self.training_dataloader = loader
            self.data_iterator = iter(loader)

    def set_dataiterator(self, iterator) -> None:
        if self.is_first_stage() or self.is_last_stage():
            self.training_dataloader = None
            self.data_iterator = iterator

    def set_batch_fn(self, fn) -> None:
        self.batch_fn = fn

    def reset_activation_shape(self) -> None:
        """DeepSpeed caches the first batch's activation shapes; here an announcement goes again whenever they
        change: nothing to reset."""

    def forward(self, *args, **kwargs):
        raise PipelineError("Only train_batch() is accessible in pipeline mode (forward() is part of it)")

    def backward(self, *args, **kwargs):
        raise PipelineError("Only train_batch() is accessible in pipeline mode (backward() is part of it)")

    def step(self, *args, **kwargs):
        raise PipelineError("Only train_batch() is accessible in pipeline mode (step() is part of it)")

    def train_batch(self, data_iter: Optional[Iterator] = None) -> torch.Tensor:
        """Train on the next ``gradient_accumulation_steps`` micro-batches of ``data_iter`` (each ``(inputs,
        labels)``; the first stage reads the inputs, the last the labels) and take one optimizer step; returns the
        mean loss of the batch over its micro-batches and data-parallel ranks, on every rank."""
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() requires gradients enabled; use eval_batch() instead")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.module.train()
        started, waited_before = time.perf_counter(), self._waited()
        losses, batch_end = self._run(self._train_schedule(), True, scalar=True, call="train_batch")
        self.agg_train_loss = self._mean_loss(losses, self.micro_batches)
        self._last_loss = self.agg_train_loss
        self.counters.micro_steps += self.micro_batches
        for instruction in batch_end:  # the reductions and the optimizer step, as the schedule orders them
            self._exec(instruction)
        self._batch.finish_reductions()  # a client's schedule may leave out ReduceGrads
        self.reporting.timers["train_batch"] += time.perf_counter() - started
        self.reporting.timers["pipe_wait"] += self._waited() - waited_before
        self.reporting.print_flops_profile()
        self._save_periodically()
        return self.agg_train_loss

    def eval_batch(
        self,
        data_iter: Iterator,
        return_logits: bool = False,
        compute_loss: bool = True,
        reduce_output: Optional[str] = "avg",
        bcast_loss: bool = True,
        num_micro_batches: Optional[int] = None,
    ):
        """Forward ``num_micro_batches`` (default: the training count) micro-batches of ``data_iter`` without
        gradients; returns the loss averaged over them and the data-parallel ranks (``reduce_output="avg"``; None:
        the last stage's list of per-micro-batch outputs), broadcast to every stage when ``compute_loss`` and
        ``bcast_loss``; with ``return_logits``, ``(loss, the last micro-batch's outputs)``."""
        if reduce_output not in ("avg", None):
            raise NotImplementedError(f"eval_batch(reduce_output={reduce_output!r}): 'avg' or None")
        micro_batches = self.micro_batches if num_micro_batches is None else num_micro_batches
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(f"eval_batch(num_micro_batches={num_micro_batches!r}): a positive int")
        schedule = self._inference_schedule(micro_batches)  # refused before the iterators are swapped
        training_iterator = self.data_iterator
        self.set_dataiterator(data_iter)
        self.module.eval()
        self._return_logits = return_logits
        try:
            with torch.no_grad():
                scalar = compute_loss and bcast_loss and reduce_output == "avg"
                outputs, _ = self._run(schedule, compute_loss, scalar, call="eval_batch")
        finally:
            self._return_logits = False
            self.set_dataiterator(training_iterator)
            self.module.train()
        if reduce_output is None:
            result = outputs if self.is_last_stage() else None
        elif compute_loss and bcast_loss:
            result = self._mean_loss(outputs, micro_batches)
        else:
            result = self._average(outputs, micro_batches) if self.is_last_stage() else None
        if return_logits:
            logits, self.outputs = self.outputs, None
            return result, logits
        return result

    # -- running a schedule -------------------------------------------------------------------------
    def _run(self, schedule: PipeSchedule, compute_loss: bool, scalar: bool, call: str) -> tuple[list, list]:
        """Run this stage's instructions of ``schedule`` up to the batch's end; returns the last stage's per-micro-
        batch losses (or outputs; ``scalar``: each must be a one-element tensor, checked as it is computed) and the
        instructions that end the batch (reductions, the optimizer step), for the caller to run once the loss is
        known.

        A failure anywhere ends every rank with a named error (the module's docstring). The end of the data at a
        batch boundary is no failure: when every rank's batch stopped because an iterator ended before anything of
        it ran, every rank raises :class:`PipelineDataExhausted` (a ``StopIteration``) and the engine goes on with
        the next iterator."""
        self._refuse_after_failure(call)
        stream = self._instructions(schedule)
        batch = self._batch = PipelineBatch(self, compute_loss, scalar, schedule)
        for exchange in self.exchanges:
            exchange.begin()
        done, agreed, batch_end = 0, False, []
        try:
            for instruction in stream:
                if isinstance(instruction, BATCH_END):  # the rest run once the loss is known
                    batch_end = [instruction, *stream]
                    break
                if batch.brings_last_gradients(instruction):
                    agreed = True
                    self._agree(None, self.mesh.stage)  # every rank of this stage got here: its reductions all run
                self._exec(instruction)
                done += 1
            if not agreed:  # a batch without backward (evaluation)
                agreed = True
                self._agree(None, self.mesh.stage)
            for exchange in self.exchanges:
                exchange.finish()
        except Exception as error:
            batch.settle_after_failure()
            exchanged = any(exchange.exchanged for exchange in self.exchanges)
            self._stop_batch(error, batch, clean=done == 0 and not exchanged, agreed=agreed)
        # a failure after the stages agreed (an out-of-memory in the last backward) reaches every rank here, before
        # the loss broadcast and the gradient norm join the stages
        try:
            self._agree(None, self.mesh.world)
        except StageAborted:
            batch.settle_after_failure()
            raise
        if batch.backwards:
            self.peak_micro_batches_in_flight = batch.peak_in_flight
        return batch.results, batch_end

    def _stop_batch(self, error: Exception, batch: PipelineBatch, clean: bool, agreed: bool) -> None:
        """The batch failed on this rank with ``error`` (``clean``: nothing of the batch ran here): tell the
        neighbours it still owes a message (``batch``'s counts) and the other ranks, then raise."""
        aborted = error if isinstance(error, StageAborted) else None
        origin = aborted.origin if aborted is not None else comm.get_rank()
        ended = isinstance(error, PipelineDataExhausted) or (aborted is not None and aborted.data_ended)
        clean = ended and clean
        source = aborted.source if aborted is not None else None
        owed = [batch.owes(phase) for phase in range(len(self.exchanges))]
        # kept for the engine's life: a word a stopped neighbour never takes stays posted
        self._stop_words += stop_neighbours(self.exchanges, origin, owed, source, data_ended=clean)
        if not agreed:
            self._agree(origin, self.mesh.stage)
        if not self._agree(origin, self.mesh.world, clean):
            self._failed = f"{type(error).__name__}: {error}".splitlines()[0]
            raise error
        if isinstance(error, PipelineDataExhausted):
            raise error
        raise PipelineDataExhausted(
            f"rank {comm.get_rank()} (pipeline stage {self.stage_id}): the data ended at a batch boundary on rank "
            f"{origin} (pipeline stage {self.mesh.dims.coordinate(origin, 'pp')}); nothing of this batch ran"
        ) from None

    def _agree(self, failed: Optional[int], group: comm.Group, clean: bool = False) -> bool:
        """Agree with the other ranks of ``group`` (this stage's, or the world at the end of a batch) on whether any
        failed (``failed``: the rank that did, as this rank knows it; ``clean``: this rank stopped because data
        ended before anything of the batch ran). A rank that did not fail raises naming the one that did and its
        stage; a failing rank learns whether every rank stopped cleanly."""
        flags = torch.tensor(
            [0 if failed is None else failed + 1, int(not clean)], dtype=torch.int64, device=self.device
        )
        comm.all_reduce(flags, group, op="max")
        origin, dirty = int(flags[0].item()) - 1, bool(flags[1].item())
        if origin >= 0 and failed is None:
            self._failed = f"rank {origin} failed"
            where = "before reducing gradients" if group is self.mesh.stage else "at the end of the batch"
            raise StageAborted(
                f"rank {comm.get_rank()} (pipeline stage {self.stage_id}): stopped {where}: rank {origin} (pipeline "
                f"stage {self.mesh.dims.coordinate(origin, 'pp')}) failed (its own error says why)",
                origin,
            )
        return not dirty

    def save_checkpoint(self, *args, **kwargs):
        """As any engine's, unless a batch of this engine failed: the stages would then disagree on what they hold."""
        self._refuse_after_failure("save_checkpoint")
        return super().save_checkpoint(*args, **kwargs)

    def _refuse_after_failure(self, call: str) -> None:
        if self._failed is not None:
            raise PipelineError(
                f"rank {comm.get_rank()}: {call}() after a failed batch of this engine ({self._failed}): its stages "
                "are out of step; build a new engine and load the last checkpoint to go on"
            )

    def _mean_loss(self, losses: list, micro_batches: int) -> torch.Tensor:
        """The last stage's mean loss over micro-batches and data-parallel ranks, broadcast to every stage."""
        result = torch.zeros(1, dtype=torch.float32, device=self.device)
        if self.is_last_stage():
            result.copy_(self._average(losses, micro_batches).reshape(1))  # one element: _Run.forward checked
        if self.mesh.pipe.size > 1:
            comm.broadcast(result, src=self.mesh.pipe.ranks[self._loss_stage], group=self.mesh.pipe)
        return result[0]

    def _average(self, values: list, micro_batches: int) -> torch.Tensor:
        """The last stage's per-micro-batch losses (or outputs, elementwise) averaged over micro-batches and
        data-parallel ranks, as DeepSpeed's ``_reduce_outputs`` averages them."""
        if not all(torch.is_tensor(v) for v in values) or len({tuple(v.shape) for v in values}) != 1:
            raise PipelineError(
                f"rank {comm.get_rank()}: reduce_output='avg' averages tensors of one shape; the last stage returned "
                f"{[tuple(v.shape) if torch.is_tensor(v) else type(v).__name__ for v in values][:4]}"
            )
        return self._batch_mean(values, micro_batches)

    def _next_batch(self, micro: int, micro_batches: int) -> Any:
        if self.data_iterator is None:
            raise PipelineError(
                f"rank {comm.get_rank()} (pipeline stage {self.stage_id}): no data: pass train_batch(data_iter) or "
                "training_data= to initialize (the first and last stages read it)"
            )
        try:
            batch = next(self.data_iterator)
        except StopIteration:
            raise PipelineDataExhausted(
                f"rank {comm.get_rank()} (pipeline stage {self.stage_id}): the data iterator ended at micro-batch "
                f"{micro} of {micro_batches}; wrap it in RepeatingLoader (deepspeed.utils) or stop the loop "
                "at the end of an epoch"
            ) from None
        if self.batch_fn is not None:
            batch = self.batch_fn(batch)
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise PipelineError(
                f"rank {comm.get_rank()}: a pipeline batch is (inputs, labels), got {type(batch).__name__}"
                + (f" of {len(batch)}" if isinstance(batch, (tuple, list)) else "")
            )
        return batch
