"""The training engine users drive: forward, backward(loss), step() every micro-batch."""

from __future__ import annotations

import atexit
import contextlib
import time
import weakref
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils._pytree import tree_map

from .. import comm
from ..accelerator import get_accelerator
from ..checkpoint.view import TrainingCounters
from ..config import Resolution
from ..log import log_rank0, logger
from ..precision import PrecisionPolicy
from ..zero import ZeroOptimizer, ZeroStack
from ..zero.stage3.layer_major import Fibers
from .activation_checkpointing import CheckpointingOptions
from .activation_checkpointing import in_effect as checkpointing_in_effect
from .activation_fit import ActivationFit
from .batch_check import check_same_batch
from .compiling import CompiledRegions, compile_regions
from .engine_api import DeepSpeedAccessors
from .engine_export import CheckpointAndExport
from .engine_hooks import ClientHooks
from .micro_batches import StepMemory, TrainBatchError, describe, loss_of, read_step
from .reporting import Reporting
from .sampler import RepeatingLoader


class NoSyncError(RuntimeError, AssertionError):
    """``no_sync()`` misused (under ZeRO 2-3, nested, or around ``step()``). An ``AssertionError`` too, because
    DeepSpeed asserts there and its clients' tests expect that class."""


class ZeroshardEngine(DeepSpeedAccessors, CheckpointAndExport, ClientHooks, torch.nn.Module):
    """Wraps the user's module; ``backward`` scales the loss by 1/gradient_accumulation_steps (and the fp16
    loss scale), gradients are averaged over data-parallel ranks, and ``step`` applies the optimizer only
    at accumulation boundaries. This class is the loop; DeepSpeed's accessors (``engine_api.py``), weights and
    checkpoints (``engine_export.py``), the hooks clients call or replace after ``initialize`` (``engine_hooks.py``)
    and what is measured and printed (``reporting.py``) live beside it."""

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        stack: ZeroStack,
        lr_scheduler: Any,
        resolution: Resolution,
        mesh: comm.Mesh,
        policy: PrecisionPolicy,
        device: torch.device,
        training_dataloader: Any = None,
        activation_checkpointing: Optional[CheckpointingOptions] = None,
        tensor_splits: dict,
        optimizer: Optional[ZeroOptimizer] = None,
        collate_fn: Optional[Callable] = None,
        attach_optimizer: Optional[Callable[[Any, Any], ZeroStack]] = None,
    ):
        super().__init__()
        self.module = module
        self.stack = stack  # every object holding this rank's model state (zeroshard.zero.stack)
        self._optimizer = optimizer  # the clients' torch.optim view of the stack (None without an optimizer)
        # (optimizer, model_parameters) -> the stack built again over them (initialize's; _configure_optimizer)
        self._attach_optimizer = attach_optimizer
        # the config's activation_checkpointing block, in effect while this engine's forward runs (None: what
        # zeroshard.runtime.activation_checkpointing.configure set)
        self.activation_checkpointing = activation_checkpointing
        self.lr_scheduler = lr_scheduler
        self.settings = resolution.config  # typed; ``config`` is DeepSpeed's dict view of it
        self._config_dict = resolution.config.model_dump(by_alias=True, mode="json")
        self.batch = resolution.batch
        self.mesh = mesh
        # how tensor and expert parallelism cut each split parameter, by name (decided once, before the engine, by
        # what placed them: ``initialize``'s parallelize)
        self.tensor_splits = tensor_splits
        self.policy = policy
        self.device = device
        self.training_dataloader = training_dataloader
        self.collate_fn = collate_fn  # initialize's: what deepspeed_io's loaders use unless given another
        self.counters = TrainingCounters()
        self.resumed_from: Optional[str] = None  # the checkpoint checkpoint.auto_resume loaded, if any
        self.resumed_client_state: Optional[dict] = None  # and the client_state saved with it
        # called at each periodic save (checkpoint.save_interval_steps); what it returns is saved as client_state
        self.checkpoint_client_state: Optional[Callable[[], dict]] = None
        self._saved_tags: set[str] = set()  # checkpoints this engine wrote (it replaces only those unasked)
        self._step_applied = False
        self._boundary_override: Optional[bool] = None  # set_gradient_accumulation_boundary
        self._in_no_sync = False
        self._last_loss: Optional[torch.Tensor] = None  # on the device; read only when reported
        self._backward_since_step = False  # a backward ran and its step() has not: a step is under way
        self._train_iterator: Optional[Any] = None  # train_batch()'s reading of training_dataloader, forever
        self.agg_train_loss: Optional[torch.Tensor] = None  # train_batch()'s last mean loss (DeepSpeed's name)
        self._activation_fit: Optional[ActivationFit] = None  # layer_major: a step measured before it runs
        self.reporting = Reporting(self.settings, module, stack, mesh, self.counters, self.batch)
        self.compiled: Optional[CompiledRegions] = None  # the regions compile() compiled in place
        self._batch_checked = mesh.tensor.size == 1  # tensor parallelism: checked at the first forward
        self._destroyed = False
        # a script that never calls destroy() still releases the engine before the process group goes
        # (atexit runs handlers last-registered first); a weak reference, so the hook keeps nothing alive
        self._at_exit = _weak_call(weakref.WeakMethod(self.destroy))
        atexit.register(self._at_exit)

    # -- the training loop ----------------------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        started = time.perf_counter()
        self.stack.refuse_if_offloaded("forward", weights_only=True)
        inputs, kwargs = tree_map(self._prepare_input, (inputs, kwargs))
        if not self._batch_checked:
            check_same_batch((inputs, kwargs), self.mesh.tensor)
            self._batch_checked = True
        self.reporting.count_tokens((inputs, kwargs))
        with self.reporting.forward(started), checkpointing_in_effect(self.activation_checkpointing):
            with self._compiled_observed():
                out = self.module(*inputs, **kwargs)
        return out

    def compile(
        self,
        backend: Optional[Any] = None,
        compile_kwargs: Optional[dict] = None,
        schedule: Any = None,
        compiled_autograd_enabled: bool = False,
    ) -> None:
        """Compile each gather unit (stage 3) or repeated block (stages 0-2) in place, its hooks outside (Note
        [per-unit compile] in ``compiling.py``): DeepSpeed's ``engine.compile``, which Accelerate calls for
        ``dynamo_backend``. ``backend`` and ``compile_kwargs`` default to the config's ``compile`` block;
        ``compile.disable: true`` leaves the model eager. Compiling twice is a no-op, as in DeepSpeed; compiling
        after steps have run compiles the regions then."""
        if self.compiled is not None:
            return
        hooked = self.stack.stage3.hooked_modules() if self.stack.stage3 is not None else ()
        self.compiled = compile_regions(
            self.module, hooked, self.settings.compile, backend, compile_kwargs, schedule, compiled_autograd_enabled
        )
        self.reporting.compiled = self.compiled
        if self.compiled is not None and self.activation_checkpointing and self.activation_checkpointing.wraps_segments:
            logger.warning("engine.compile(): activation_checkpointing's cpu_checkpointing, synchronize and profile "
                           "do not apply inside compiled regions (checkpoint() runs there as torch's)")  # fmt: skip

    def empty_partition_cache(self) -> None:
        """Drop the idle gather and staging buffers the stack keeps for reuse (DeepSpeed's call, which OpenRLHF
        makes before handing the device to another model); the next step allocates them again."""
        self.stack.buffers.clear()
        get_accelerator().empty_cache()

    def offload_states(
        self, include=None, device: Any = "cpu", pin_memory: bool = True, non_blocking: bool = False
    ) -> None:
        """DeepSpeed's ``engine.offload_states``: the optimizer's, after dropping the idle buffers."""
        self.stack.needs_optimizer("offload_states").offload_states(include, device, pin_memory, non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        self.stack.needs_optimizer("reload_states").reload_states(non_blocking)

    @property
    def is_compiled(self) -> bool:
        return self.compiled is not None

    def _compiled_observed(self):
        return self.compiled.observed() if self.compiled is not None else contextlib.nullcontext()

    def __getattr__(self, name: str):
        """What the engine does not define comes from the wrapped module (``engine.generate(...)``, custom
        methods and attributes), as DeepSpeed's engine does."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is not None and hasattr(module, name):
                return getattr(module, name)
            raise AttributeError(f"'{type(self).__name__}' object (and its module) has no attribute '{name}'") from None

    def _prepare_input(self, value):
        if not torch.is_tensor(value):
            return value
        if value.is_floating_point() and self.policy.compute != torch.float32:
            return value.to(self.device, self.policy.compute)
        return value.to(self.device)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        scale = self.stack.loss_scale
        if scale_wrt_gas:
            scale /= self.batch.gradient_accumulation_steps
        self._last_loss = loss.detach()
        self._backward_since_step = True
        self._backward_from([loss.float() * scale], None, self.is_gradient_accumulation_boundary(), retain_graph)
        return loss

    def _backward_from(
        self, tensors: list, grads: Optional[list], boundary: bool, retain_graph: bool = False, finish: bool = True
    ) -> None:
        """Backward from ``tensors`` (the scaled loss, or a pipeline stage's outputs with the gradients the next stage
        sent back) through the stack's hooks; ``boundary``: it ends a gradient accumulation (the reductions run);
        ``finish``: wait for them here (a pipeline stage waits later: ``stack.end_backward``)."""
        self._backward_with(
            lambda: torch.autograd.backward(tensors, grads, retain_graph=retain_graph),
            boundary,
            finish,
            root=tensors[0],
            retain_graph=retain_graph,
        )

    def _backward_with(
        self,
        run: Callable[[], None],
        boundary: bool,
        finish: bool = True,
        root: Optional[torch.Tensor] = None,
        retain_graph: bool = False,
    ) -> None:
        """``run`` (the autograd calls that bring the parameters' gradients) inside the stack's backward: its
        reductions launched as gradients arrive (``root``: the tensor the outer backward starts from, when there
        is one; a zero-bubble W starts from several inside nodes)."""
        started = time.perf_counter()
        self.stack.refuse_if_offloaded("backward")
        self.stack.begin_backward(boundary, root)
        with self._compiled_observed():  # activation checkpointing recomputes compiled regions here
            run()
        self.reporting.sample_memory()
        reduce_started = time.perf_counter()
        if finish:
            self.stack.end_backward(graph_retained=retain_graph)
        self.reporting.timers["backward"] += reduce_started - started
        self.reporting.timers["reduce_wait"] += time.perf_counter() - reduce_started

    def step(self) -> None:
        if self._in_no_sync:
            raise NoSyncError(
                "It is illegal to call Engine.step() inside no_sync context manager (DeepSpeed's words): gradients "
                "there are not reduced, so no optimizer step may use them; call step() after the no_sync block"
            )
        self.stack.refuse_if_offloaded("step")
        self._step_applied = False
        self._backward_since_step = False
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:
            self._optimizer_step()
        self.counters.micro_steps += 1
        if boundary:
            self.reporting.print_flops_profile()
            self._save_periodically()

    def train_batch(self, data_iter: Optional[Iterator] = None) -> torch.Tensor:
        """One optimizer step over the next ``gradient_accumulation_steps`` micro-batches of ``data_iter`` (DeepSpeed's
        pipeline-engine call, on any engine): each micro-batch runs forward, backward and ``step()`` as a loop written
        against the engine would run it, and the mean loss over the micro-batches and data-parallel ranks comes back
        on every rank. Without ``data_iter``: the ``training_data`` given to ``initialize``, read forever. A
        micro-batch is called as the model takes it (a tuple or list as positional arguments, a dict as keyword
        arguments, anything else as the one argument); the model returns the loss (a one-element tensor, an output
        with ``.loss``, a dict with ``"loss"``, or a tuple starting with it). Every micro-batch is read before any
        runs, and the ranks agree that each has all of them (one small collective), so data that ends early on one
        rank is an error on every rank, not a wait."""
        if self._in_no_sync or self._boundary_override is not None:
            raise TrainBatchError(
                f"rank {comm.get_rank()}: train_batch() ends the accumulation itself; it cannot run inside no_sync() "
                "or after set_gradient_accumulation_boundary()"
            )
        gas = self.batch.gradient_accumulation_steps
        if self.micro_steps % gas or self._backward_since_step:
            raise TrainBatchError(
                f"rank {comm.get_rank()}: train_batch() while a step is under way ({self.micro_steps % gas} of {gas} "
                "micro-batches stepped through forward/backward/step"
                + (", and a backward without its step()" if self._backward_since_step else "")
                + "); finish it with engine.step() first, or use train_batch() for whole steps only"
            )
        started = time.perf_counter()
        batches = self._read_batches(data_iter, gas)
        if self.settings.zero_optimization.layer_major:
            losses = self._layer_major(batches)
        else:
            losses = []
            for micro, batch in enumerate(batches):
                try:
                    loss = loss_of(self._call(batch))
                except Exception as error:
                    self._undo_batch(error, micro, micro, batches)
                    raise
                self.backward(loss)
                self.step()
                losses.append(loss.detach())
        self.agg_train_loss = self._batch_mean(losses, gas)
        self.reporting.timers["train_batch"] += time.perf_counter() - started
        return self.agg_train_loss

    def _call(self, batch: Any) -> Any:
        if isinstance(batch, (tuple, list)):
            return self(*batch)
        return self(**batch) if isinstance(batch, dict) else self(batch)

    def _undo_batch(self, error: Exception, stepped: int, failed: int, batches: list) -> None:
        """Micro-batch ``failed`` failed after ``stepped`` ran their backward and step(): their gradients, which no
        step will use, are dropped and the count of micro-batches is back at the step's start, so the engine is as it
        was before ``train_batch``."""
        self.zero_grad()
        if self.stack.stage3 is not None:
            self.stack.stage3.release_all()
        self.counters.micro_steps -= stepped
        self._backward_since_step = False
        error.add_note(
            f"rank {comm.get_rank()}: in train_batch(), micro-batch {failed + 1} of {len(batches)} "
            f"({describe(batches[failed])}); the batch was not applied: the gradients of the micro-batches before it "
            "were dropped"
        )

    def _layer_major(self, batches: list) -> list:
        """``zero_optimization.layer_major`` (Note [layer-major] in zero/stage3/layer_major.py): the micro-batches'
        forwards unit by unit, one backward of their scaled losses summed in order, then the step."""
        gas, fibers = len(batches), Fibers()
        try:
            with self.stack.stage3.layer_major(fibers):
                outs = fibers.run([lambda batch=batch: self._call(batch) for batch in batches])
            losses = [loss_of(out) for out in outs]
        except Exception as error:
            self._undo_batch(error, 0, fibers.failed if fibers.failed is not None else 0, batches)
            raise
        scale = self.stack.loss_scale / gas
        total = losses[0].float() * scale
        for loss in losses[1:]:
            total = total + loss.float() * scale
        self._last_loss = losses[-1].detach()
        self._backward_from([total], None, boundary=True)
        self.counters.micro_steps += gas - 1  # the step below counts the last one and ends the accumulation
        self.step()
        return [loss.detach() for loss in losses]

    def _read_batches(self, data_iter: Optional[Iterator], count: int) -> list:
        if data_iter is None:
            if self.training_dataloader is None:
                raise TrainBatchError(
                    f"rank {comm.get_rank()}: train_batch() has no data: pass train_batch(data_iter) or "
                    "training_data= to initialize"
                )
            if self._train_iterator is None:
                self._train_iterator = RepeatingLoader(self.training_dataloader)
            data_iter = self._train_iterator
        return read_step(data_iter, count, self.mesh.world, self.device, self._measure_step)

    def _measure_step(self, batches: list) -> Optional[StepMemory]:
        """Under ``layer_major``, the memory the step's micro-batches need together (``activation_fit.py``)."""
        if not self.settings.zero_optimization.layer_major or len(batches) < 2:
            return None
        if self._activation_fit is None:
            self._activation_fit = ActivationFit(self.module, self.stack.stage3, self.policy.compute)
        with checkpointing_in_effect(self.activation_checkpointing):
            return self._activation_fit.measure(batches)

    def _batch_mean(self, values: list, micro_batches: int) -> torch.Tensor:
        """Per-micro-batch losses (or outputs, elementwise) summed over micro-batches, divided by their count and
        averaged over the data-parallel ranks, as DeepSpeed's pipeline engine reduces them, and over the sequence-
        parallel ones: each holds its tokens' mean (equal token counts: their average is the sample's) or the
        sample's own (``token_weighted_loss``: the same value on each)."""
        total = torch.stack([v.detach().float() for v in values]).sum(0) / micro_batches
        if self.mesh.gradient.size > 1:
            comm.all_reduce(total, self.mesh.gradient)
            total /= self.mesh.gradient.size
        return total

    def _optimizer_step(self) -> None:
        started = time.perf_counter()
        plain = self.settings.zero_optimization.stage == 0 and self.policy.compute == torch.float32
        if plain and self.settings.gradient_clipping > 0:
            self.clip_fp32_gradients()  # where DeepSpeed calls it: clipping on, no ZeRO, no fp16/bf16
        # through the torch view when there is one: its step hooks run, and a torch scheduler set on it afterwards
        # (``engine.lr_scheduler = LinearLR(engine.optimizer, ...)``) sees the optimizer step first
        self._step_applied = self.stack.step() if self._optimizer is None else self._optimizer.step()
        if self._step_applied:
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        else:
            self.counters.skipped_steps += 1
            log_rank0(
                f"step {self.global_steps + 1}: gradient overflow, step skipped, "
                f"loss scale now {self.stack.loss_scale:g}"
            )
        self.counters.global_steps += 1
        self.counters.global_samples += self.batch.train_batch_size
        self.reporting.timers["optimizer_step"] += time.perf_counter() - started
        if self.reporting.step_taken(self._last_loss):
            self._report_progress(self.global_steps)

    def _save_periodically(self) -> None:
        """``checkpoint.save_interval_steps``: a checkpoint into ``checkpoint.save_dir`` every N optimizer steps,
        taken after the step so a restart resumes at an accumulation boundary."""
        every = self.settings.checkpoint.save_interval_steps
        if every and self.global_steps % every == 0:
            client = self.checkpoint_client_state() if self.checkpoint_client_state is not None else None
            self.save_checkpoint(self.settings.checkpoint.save_dir, client_state=client)

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._in_no_sync:
            return False
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.batch.gradient_accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Let the caller decide where accumulation ends (Accelerate counts micro-batches itself and calls
        ``step`` only at boundaries); from the first call on, the engine's own count no longer decides."""
        self._boundary_override = bool(is_boundary)

    @contextlib.contextmanager
    def no_sync(self):
        """DDP's ``no_sync``: backward passes inside accumulate gradients locally, unreduced (no micro-batch
        inside is an accumulation boundary; ``step()`` inside is refused, as DeepSpeed asserts). Stages 0 and 1
        reduce once per boundary anyway; stages 2 and 3 reduce each micro-batch as its gradients appear (each rank
        keeps only a shard) and refuse it, as DeepSpeed does. Not reentrant."""
        if self._in_no_sync:
            raise NoSyncError("no_sync context manager reentry is unsupported (no_sync() inside no_sync())")
        if self.zero_optimization_stage() >= 2:
            raise NoSyncError(
                "no_sync context manager is incompatible with gradient partitioning logic of ZeRO stage "
                f"{self.zero_optimization_stage()}: gradients are reduced as they are produced so that each rank keeps "
                "only its shard; use gradient_accumulation_steps (engine.backward/step) instead"
            )
        self._in_no_sync = True
        try:
            yield
        finally:
            self._in_no_sync = False

    def zero_grad(self) -> None:
        self.stack.zero_grad(self.module)

    def destroy(self) -> None:
        """Release what the engine holds (DeepSpeed's name): finish reductions in flight, remove the gradient
        and stage-3 module hooks (under stage 3 the module is unusable afterwards), and tear down the process
        groups it created. Idempotent; also run at interpreter exit for scripts that never call it."""
        if self._destroyed:
            return
        self._destroyed = True
        atexit.unregister(self._at_exit)
        self.stack.destroy()
        comm.destroy_mesh(self.mesh)
        self.reporting.close()


def _weak_call(method: weakref.WeakMethod):
    def call() -> None:
        bound = method()
        if bound is not None:
            bound()

    return call
