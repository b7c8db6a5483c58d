"""The training engine users drive: forward, backward(loss), step() every micro-batch."""

from __future__ import annotations

import atexit
import contextlib
import functools
import inspect
import os
import time
import weakref
from collections import defaultdict
from typing import Any, Callable, Optional

import torch
from torch.utils._pytree import tree_flatten, tree_map

from .. import comm
from ..accelerator import get_accelerator
from ..checkpoint.load import load as load_training_state
from ..checkpoint.save import save as save_training_state
from ..checkpoint.view import TrainingCounters, TrainingState
from ..config import Resolution
from ..log import log_rank0, logger
from ..precision import PrecisionPolicy
from ..profiling import FlopsProfiler
from ..tensor_parallel import layer_specs_from, splits_at, tensor_splits
from ..zero import ParamAccess, ParamRecords, ZeroOptimizer, ZeroStack, consolidated_state_dict
from ..zero.assemble import NO_OPTIMIZER
from ..zero.stage3 import Stage3Runtime
from .activation_checkpointing import CheckpointingOptions
from .activation_checkpointing import in_effect as checkpointing_in_effect
from .batch_check import check_same_batch
from .memory import MemoryTracker, format_table
from .monitor import Monitors


class NoSyncError(RuntimeError, AssertionError):
    """``no_sync()`` misused (under ZeRO 2-3, nested, or around ``step()``). An ``AssertionError`` too, because
    DeepSpeed asserts there and its clients' tests expect that class."""


class ZeroshardEngine(torch.nn.Module):
    """Wraps the user's module; ``backward`` scales the loss by 1/gradient_accumulation_steps (and the fp16
    loss scale), gradients are averaged over data-parallel ranks, and ``step`` applies the optimizer only
    at accumulation boundaries."""

    def __init__(
        self,
        module: torch.nn.Module,
        stack: ZeroStack,
        lr_scheduler: Any,
        resolution: Resolution,
        grid: comm.RankGrid,
        policy: PrecisionPolicy,
        device: torch.device,
        training_dataloader: Any = None,
        *,
        activation_checkpointing: Optional[CheckpointingOptions] = None,
    ):
        super().__init__()
        self.module = module
        self.stack = stack  # every object holding this rank's model state (zeroshard.zero.assemble)
        # the config's activation_checkpointing block, in effect while this engine's forward runs (None: what
        # zeroshard.runtime.activation_checkpointing.configure set)
        self.activation_checkpointing = activation_checkpointing
        self.lr_scheduler = lr_scheduler
        self.settings = resolution.config  # typed; ``config`` is DeepSpeed's dict view of it
        self._config_dict = resolution.config.model_dump(by_alias=True, mode="json")
        self.batch = resolution.batch
        self.grid = grid
        self.policy = policy
        self.device = device
        self.training_dataloader = training_dataloader
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
        self._timers: dict[str, float] = defaultdict(float)
        self._window_start = time.perf_counter()
        self._window_tokens = 0
        self._memory_reported = False
        # model-state bytes are sampled (a walk over every owner) only while a report is to come: until the
        # first steps_per_print line prints the table, or throughout with memory_breakdown: true
        self._sampling_memory = bool(self.settings.steps_per_print) or self.settings.memory_breakdown
        self.monitors = Monitors(self.settings, comm.get_rank())
        self.memory = MemoryTracker()
        self._sample_memory(always=True)
        if self.settings.comms_logger.enabled:
            self.grid.context.timing = True  # this engine's collectives only
        self._compiled: Optional[Callable] = None  # the module compiled by compile(), called by forward
        block = self.settings.flops_profiler
        # DeepSpeed's: rank 0 profiles one forward (of step block.profile_step) and prints it after that step
        self.flops_profiler = (
            FlopsProfiler(module, recompute_fwd_factor=block.recompute_fwd_factor)
            if block.enabled and comm.get_rank() == 0
            else None
        )
        self._profile_started: Optional[float] = None
        self._batch_checked = grid.tensor.size == 1  # tensor parallelism: checked at the first forward
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
            check_same_batch((inputs, kwargs), self.grid.tensor)
            self._batch_checked = True
        tokens = next(
            (t for t in tree_flatten((inputs, kwargs))[0] if torch.is_tensor(t) and not t.is_floating_point()), None
        )
        self._window_tokens += tokens.numel() if tokens is not None else 0  # token ids: batch x sequence
        profiling = self._profiling_now()
        if profiling:
            self._profile_started = started
            self.flops_profiler.start_profile()
        with checkpointing_in_effect(self.activation_checkpointing):
            out = (self.module if self._compiled is None else self._compiled)(*inputs, **kwargs)
        if profiling:
            self.flops_profiler.stop_profile()
        self._timers["forward"] += time.perf_counter() - started
        self._sample_memory()
        return out

    def compile(
        self, backend: Optional[str] = None, compile_kwargs: Optional[dict] = None, schedule: Any = None
    ) -> None:
        """Compile the module with ``torch.compile`` (DeepSpeed's ``engine.compile``, which Accelerate calls when
        ``dynamo_backend`` is set). ``backend`` and ``compile_kwargs`` default to the config's ``compile`` block;
        ``compile.disable: true`` leaves the module uncompiled. Compiling twice is a no-op, as in DeepSpeed."""
        if schedule is not None:
            raise NotImplementedError("engine.compile(schedule=...): DeepCompile's pass schedules are not implemented")
        block = self.settings.compile
        if block.disable:
            logger.warning("engine.compile(): the config's compile.disable is true; the module stays uncompiled")
            return
        if self._compiled is None:
            if compile_kwargs is not None and not isinstance(compile_kwargs, dict):
                raise TypeError(f"engine.compile(compile_kwargs=...) takes a dict, not {type(compile_kwargs).__name__}")
            options = {**block.kwargs, **(compile_kwargs or {})}
            backend = backend or block.backend
            if not (isinstance(backend, str) or callable(backend)):
                raise TypeError(f"engine.compile(backend={backend!r}): a backend is a name ('inductor') or a callable")
            accepted = set(inspect.signature(torch.compile).parameters) - {"model", "backend"}
            unknown = sorted(set(options) - accepted)
            if unknown:
                raise TypeError(
                    f"engine.compile(): {unknown} are not torch.compile options (compile_kwargs / the config's "
                    f"compile.kwargs); it takes {sorted(accepted)}"
                )
            self._compiled = torch.compile(self.module, backend=backend, **options)

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
    def monitor(self) -> Monitors:
        """DeepSpeed's ``engine.monitor``: ``engine.monitor.write_events([(name, value, step)])``."""
        return self.monitors

    @property
    def is_compiled(self) -> bool:
        return self._compiled is not None

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

    def _sample_memory(self, always: bool = False) -> None:
        if always or self._sampling_memory:
            self.memory.sample(self.stack.state_bytes_by_location(), get_accelerator().max_memory_allocated())

    def memory_breakdown(self) -> dict[str, list[dict[str, int]]]:
        """Model-state bytes by category (parameters, gradients, optimizer state, communication buffers,
        gathered units; and per location) at start and at the largest sample, for every rank: a collective.
        Samples are taken after forward, backward and the step while a report is to come (until the first
        ``steps_per_print`` report, or throughout with ``memory_breakdown: true``)."""
        return self.memory.all_ranks(self.grid.world)

    def _prepare_input(self, value):
        if not torch.is_tensor(value):
            return value
        if value.is_floating_point() and self.policy.compute != torch.float32:
            return value.to(self.device, self.policy.compute)
        return value.to(self.device)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        started = time.perf_counter()
        self.stack.refuse_if_offloaded("backward")
        scale = self.stack.loss_scale
        if scale_wrt_gas:
            scale /= self.batch.gradient_accumulation_steps
        scaled = loss.float() * scale
        self.stack.begin_backward(self.is_gradient_accumulation_boundary(), scaled)
        self._last_loss = loss.detach()
        scaled.backward(retain_graph=retain_graph)
        self._sample_memory()
        reduce_started = time.perf_counter()
        self.stack.end_backward(graph_retained=retain_graph)
        self._timers["backward"] += reduce_started - started
        self._timers["reduce_wait"] += time.perf_counter() - reduce_started
        return loss

    def step(self) -> None:
        if self._in_no_sync:
            raise NoSyncError(
                "It is illegal to call Engine.step() inside no_sync context manager (DeepSpeed's words): gradients "
                "there are not reduced, so no optimizer step may use them; call step() after the no_sync block"
            )
        self.stack.refuse_if_offloaded("step")
        self._step_applied = False
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:
            self._optimizer_step()
        self.counters.micro_steps += 1
        if boundary:
            self._print_flops_profile()
            self._save_periodically()

    def _profiling_now(self) -> bool:
        """The first forward of the profiled step (DeepSpeed counts it in steps already taken)."""
        return (
            self.flops_profiler is not None
            and self._profile_started is None
            and self.global_steps == self.settings.flops_profiler.profile_step
        )

    def _print_flops_profile(self) -> None:
        if self._profile_started is None or not self.flops_profiler.stats:
            return
        block = self.settings.flops_profiler
        self.flops_profiler.print_model_profile(
            profile_step=block.profile_step,
            module_depth=block.module_depth,
            top_modules=block.top_modules,
            detailed=block.detailed,
            output_file=block.output_file,
            step_duration=time.perf_counter() - self._profile_started,
        )
        self.flops_profiler.end_profile()

    def _optimizer_step(self) -> None:
        started = time.perf_counter()
        self._step_applied = self.stack.step()
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
        self._timers["optimizer_step"] += time.perf_counter() - started
        self._sample_memory()
        if self.monitors.enabled:
            self.monitors.write(
                [
                    ("Train/Samples/train_loss", self._last_loss_value(), self.global_samples),
                    ("Train/Samples/lr", self.get_lr()[0], self.global_samples),
                    ("Train/Samples/loss_scale", self.stack.loss_scale, self.global_samples),
                    ("Train/Samples/grad_norm", self.get_global_grad_norm(), self.global_samples),
                ]
            )
        if self.settings.steps_per_print and self.global_steps % self.settings.steps_per_print == 0:
            self._report()

    def _save_periodically(self) -> None:
        """``checkpoint.save_interval_steps``: a checkpoint into ``checkpoint.save_dir`` every N optimizer steps,
        taken after the step so a restart resumes at an accumulation boundary."""
        every = self.settings.checkpoint.save_interval_steps
        if every and self.global_steps % every == 0:
            client = self.checkpoint_client_state() if self.checkpoint_client_state is not None else None
            self.save_checkpoint(self.settings.checkpoint.save_dir, client_state=client)

    def _last_loss_value(self) -> Optional[float]:
        """The last micro-batch's loss as a number (a device sync: only when logging or monitoring)."""
        return None if self._last_loss is None else self._last_loss.float().item()

    def _report(self) -> None:
        elapsed = time.perf_counter() - self._window_start
        samples = self.settings.steps_per_print * self.batch.train_batch_size
        norm = self.get_global_grad_norm()
        clip = self.settings.gradient_clipping
        clipped = min(norm, clip) if clip > 0 and norm is not None else norm
        tokens = self._window_tokens * self.grid.data.size  # every rank of the data group ran different tokens
        log_rank0(
            f"step {self.global_steps}: loss {self._last_loss_value():.4f} lr {self.get_lr()[0]:.3e} "
            f"loss_scale {self.stack.loss_scale:g} grad_norm {norm:.4f} (clipped {clipped:.4f}) "
            f"samples/s {samples / elapsed:.1f} tokens/s {tokens / elapsed:.0f} skipped {self.skipped_steps}"
        )
        if self.settings.wall_clock_breakdown:
            if self.stack.stage3 is not None:
                self._timers["gather_wait"] = self.stack.take_gather_seconds()
            log_rank0("time (s) " + " ".join(f"{k} {v:.3f}" for k, v in sorted(self._timers.items())))
        if self.settings.comms_logger.enabled:
            log_rank0(self.comm_ledger.format())
        compressed = {op: t for (op, _), t in self.comm_ledger.totals.items() if op.endswith("_1bit")}
        if compressed:  # a 1-bit optimizer past its warm-up: what the compressed collectives sent so far
            log_rank0(
                "1-bit communication since start: "
                + ", ".join(f"{op} {t.calls} calls {t.wire_bytes / 1e6:.3f} MB sent" for op, t in compressed.items())
                + f"; all collectives {self.comm_ledger.total_wire_bytes() / 1e6:.3f} MB sent"
            )
        # the model-state memory of every rank at start and at its peak: once, or every report with memory_breakdown
        if not self._memory_reported or self.settings.memory_breakdown:
            self._memory_reported = True
            log_rank0(format_table(self.memory_breakdown()))
            self._sampling_memory = self.settings.memory_breakdown
        self._timers.clear()
        self._window_tokens = 0
        self._window_start = time.perf_counter()

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
        comm.destroy_groups(self.grid)
        self.monitors.close()

    # -- state queries (DeepSpeed names) --------------------------------------------------------
    @property
    def optimizer(self) -> Optional[ZeroOptimizer]:
        """The ZeRO optimizer (None for an engine built without one); ``zero`` is the same object."""
        return self.stack.optimizer

    zero = optimizer

    @property
    def stage3(self) -> Optional[Stage3Runtime]:
        """The stage-3 runtime (gather units and their hooks), or None below stage 3."""
        return self.stack.stage3

    @property
    def param_access(self) -> ParamAccess:
        """One parameter's fp32 master weights, reduced gradient and optimizer state, whole or this rank's part
        (DeepSpeed's ``safe_get_full_fp32_param`` family; see :mod:`zeroshard.zero.param_access`)."""
        if self.stack.access is None:
            raise RuntimeError(f"engine.param_access {NO_OPTIMIZER}")
        return self.stack.access

    @property
    def records(self) -> ParamRecords:
        """What the engine knows of its (stage-3) parameters."""
        return self.stack.records

    @property
    def global_steps(self) -> int:
        """Optimizer steps taken (applied or skipped for overflow)."""
        return self.counters.global_steps

    @property
    def global_samples(self) -> int:
        return self.counters.global_samples

    @property
    def skipped_steps(self) -> int:
        return self.counters.skipped_steps

    @property
    def micro_steps(self) -> int:
        return self.counters.micro_steps

    @property
    def comm_ledger(self) -> comm.CommLedger:
        """Bytes and calls of this engine's collectives (the process's total: ``zeroshard.comm.LEDGER``)."""
        return self.grid.context.ledger

    def was_step_applied(self) -> bool:
        return self._step_applied

    def get_lr(self) -> list[float]:
        return self.stack.learning_rates()

    def get_global_grad_norm(self) -> Optional[float]:
        return self.stack.global_grad_norm

    def get_loss_scale(self) -> float:
        return self.stack.loss_scale

    def train_batch_size(self) -> int:
        return self.batch.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.batch.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self.batch.gradient_accumulation_steps

    def zero_optimization_stage(self) -> int:
        return self.settings.zero_optimization.stage

    def zero_optimization(self) -> bool:
        """Whether ZeRO shards anything (stage 1 or more), as DeepSpeed's getter answers."""
        return self.settings.zero_optimization.stage > 0

    def gradient_clipping(self) -> float:
        """The global gradient norm the step clips to (0: off); DeepSpeed's default 1.0 when the config is silent."""
        return self.settings.gradient_clipping

    def wall_clock_breakdown(self) -> bool:
        return self.settings.wall_clock_breakdown

    def get_wall_clock_timers(self) -> dict[str, float]:
        """Milliseconds spent so far in each timed phase (forward, backward, reduce_wait, optimizer_step, ...), with
        ``wall_clock_breakdown`` on; an empty dict otherwise (DeepSpeed's snapshot of its engine timers)."""
        if not self.settings.wall_clock_breakdown:
            return {}
        return {name: 1000.0 * seconds for name, seconds in self._timers.items()}

    def print_forward_breakdown(self, fwd_time: float) -> None:
        """DeepSpeed prints its MoE layers' forward times here; zeroshard has no expert layers, so the forward's."""
        log_rank0(f"time (ms) | fwd: {fwd_time:.2f}")

    def curriculum_learning_enabled(self) -> bool:
        return False  # the data-efficiency library is refused by the config

    def random_ltd_enabled(self) -> bool:
        return False  # likewise

    def module_state_dict(
        self, destination=None, prefix: str = "", keep_vars: bool = False, exclude_frozen_parameters: bool = False
    ) -> dict:
        """The module's own ``state_dict`` (under stage 3 what this rank holds of it: gather with
        ``consolidated_state_dict`` for whole weights), without frozen parameters if asked, as DeepSpeed's."""
        state = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            for name, param in self.module.named_parameters():
                if not param.requires_grad:
                    state.pop(prefix + name, None)
        return state

    def fp16_enabled(self) -> bool:
        return self.policy.compute == torch.float16

    def bfloat16_enabled(self) -> bool:
        return self.policy.compute == torch.bfloat16

    @property
    def global_rank(self) -> int:
        return comm.get_rank()

    @property
    def local_rank(self) -> int:
        return comm.backend.local_rank()

    @property
    def config(self) -> dict:
        """The resolved configuration as DeepSpeed's dict (its key names, every ``"auto"`` filled in)."""
        return self._config_dict

    @property
    def world_size(self) -> int:
        return self.grid.world.size

    @property
    def dp_world_size(self) -> int:
        """Data-parallel ranks: the world over the tensor- and sequence-parallel degrees (DeepSpeed's attribute)."""
        return self.grid.data_parallel_size

    @property
    def sequence_parallel_size(self) -> int:
        """Ranks of a sequence-parallel group (1: none), as ``sequence_parallel_size`` or the ``mpu`` set it."""
        return self.grid.sequence.size

    @property
    def seq_dp_world_size(self) -> int:
        """The ranks ZeRO shards and reduces over: data x sequence (DeepSpeed's attribute)."""
        return self.grid.data.size

    def autotp_size(self) -> int:
        """Ranks of a tensor-parallel group (1: none), as ``tensor_parallel.autotp_size`` or ``tp_model_init`` set."""
        return self.grid.tensor.size

    def consolidated_state_dict(self, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The module's full state dict on CPU in the compute dtype. Under stage 3 it is gathered one flat
        group at a time, so no rank ever holds more than one gathered unit besides the result; under tensor
        parallelism each split parameter's pieces are joined. Every rank must call it; with ``rank0_only`` the
        others get ``{}``."""
        self.stack.refuse_if_offloaded("consolidated_state_dict", weights_only=True)
        return consolidated_state_dict(
            self.module,
            self.stack.all_flat_groups,
            rank0_only=rank0_only,
            tensor_group=self.grid.tensor,
            splits=tensor_splits(self.module),
        )

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """DeepSpeed's name for ``stage3_gather_16bit_weights_on_model_save``."""
        return self.settings.zero_optimization.gather_16bit_weights_on_model_save

    def _consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict:
        """DeepSpeed's name for the full state dict when weights are split (stage 3 or tensor parallelism), which
        Accelerate saves through: on rank 0, ``{}`` elsewhere (every rank must call it)."""
        if self.zero_optimization_stage() != 3 and self.autotp_size() == 1:
            raise ValueError(
                "_consolidated_16bit_state_dict applies when weights are split (ZeRO stage 3 or "
                "tensor_parallel.autotp_size > 1); use engine.module.state_dict()"
            )
        return self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict:
        """The full compute-dtype state dict on rank 0 (``{}`` elsewhere), gathered unit by unit; the name
        Accelerate and HF call (every rank must call it)."""
        state = self.consolidated_state_dict(rank0_only=True)
        if exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        return state

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
        """Write the full compute-dtype weights from rank 0 (every rank must call it). Under stage 3 this needs
        ``stage3_gather_16bit_weights_on_model_save``; returns whether a file was written."""
        if self.zero_optimization_stage() == 3 and not self.zero_gather_16bit_weights_on_model_save():
            log_rank0(
                "save_16bit_model: not saved, because zero_optimization.stage3_gather_16bit_weights_on_model_save "
                "is false (set it to true to gather the sharded weights)"
            )
            return False
        state = self.consolidated_state_dict(rank0_only=True)
        if comm.get_rank() == 0:
            os.makedirs(save_dir, exist_ok=True)
            path = os.path.join(save_dir, save_filename)
            torch.save(state, path + ".tmp")
            os.replace(path + ".tmp", path)  # never leave a half-written file under the final name
        comm.barrier(self.grid.world)
        return True

    def save_checkpoint(
        self,
        save_dir: str,
        tag: Optional[str] = None,
        client_state: Optional[dict] = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> str:
        """Save the full training state (every rank calls it); default tag ``global_step{N}``. ``client_state``
        may hold JSON values and tensors. See :mod:`zeroshard.checkpoint.save` for the format and guarantees.
        A tag the caller names replaces a checkpoint of that tag (as DeepSpeed does); a default step tag that this
        engine did not write (a checkpoint already in ``save_dir`` after a resume from an older step) is kept
        under another name instead."""
        if not isinstance(save_dir, (str, os.PathLike)) or not os.fspath(save_dir):
            raise ValueError(f"save_checkpoint(save_dir={save_dir!r}): name the directory to save into")
        save_dir = os.fspath(save_dir)
        step_tag = f"global_step{self.global_steps}"
        path = save_training_state(
            self._training_state(),
            save_dir,
            tag=tag,
            client_state=client_state,
            save_latest=save_latest,
            exclude_frozen_parameters=exclude_frozen_parameters,
            keep_replaced=tag is None and os.path.abspath(os.path.join(save_dir, step_tag)) not in self._saved_tags,
        )
        self._saved_tags.add(os.path.abspath(path))
        return path

    def load_checkpoint(
        self,
        load_dir: str,
        tag: Optional[str] = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
    ):
        """Load a checkpoint saved with any world size and stage; returns ``(load_path, client_state)``,
        or ``(None, None)`` with a warning when ``load_dir`` holds no checkpoint."""
        self.stack.refuse_if_offloaded("load_checkpoint")  # it would write into freed storages
        restored = load_training_state(
            self._training_state(),
            load_dir,
            tag=tag,
            load_module_strict=load_module_strict,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only,
        )
        return restored.path, restored.client_state

    def _training_state(self) -> TrainingState:
        """The engine as a checkpoint sees it (``zeroshard.checkpoint.view``)."""
        sampler = getattr(self.training_dataloader, "sampler", None)
        resumable = hasattr(sampler, "load_state_dict") and hasattr(sampler, "consumed")  # zeroshard's own
        return TrainingState(
            module=self.module,
            grid=self.grid,
            config=self.settings,
            counters=self.counters,
            flat_groups=self.stack.flat_groups,
            frozen_groups=self.stack.frozen_groups,
            optimizer=self.stack.optimizer,
            lr_scheduler=self.lr_scheduler,
            sampler=sampler if resumable else None,
            gradient_accumulation_steps=self.gradient_accumulation_steps(),
            fp16=self.fp16_enabled(),
            tensor_splits=tensor_splits(self.module),
            splits_at=functools.partial(
                splits_at,
                self.module,
                layer_specs=layer_specs_from(self.settings.tensor_parallel),
                use_default_specs=self.settings.tensor_parallel.partition_config.use_default_specs,
            ),
        )

    def state_bytes(self) -> dict[str, int]:
        """Model-state bytes held by this rank (parameters, master weights, gradient shards, optimizer state)."""
        return self.stack.state_bytes()

    def state_bytes_by_location(self) -> dict[str, dict[str, int]]:
        """The same, split by where it lives: ``device``, ``host`` (offloaded) and ``nvme`` (swap files)."""
        return self.stack.state_bytes_by_location()


def _weak_call(method: weakref.WeakMethod):
    def call() -> None:
        bound = method()
        if bound is not None:
            bound()

    return call
