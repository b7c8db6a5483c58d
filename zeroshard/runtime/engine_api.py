"""DeepSpeed's engine accessors, beside the loop: what clients (HF Trainer, Accelerate, Lightning, DeepSpeed
scripts) read off an engine (batch sizes, stage, ranks and group sizes, learning rates, norms, timers), by DeepSpeed's
names. A base class of :class:`~zeroshard.runtime.engine.ZeroshardEngine`; it reads the engine's own objects
(settings, batch triad, mesh, stack, counters, reporting) and changes nothing."""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from .. import comm
from ..accelerator import get_accelerator
from ..log import log_rank0
from ..zero import ParamAccess, ParamRecords, ZeroOptimizer
from ..zero.stack import NO_OPTIMIZER
from ..zero.stage3 import Stage3Runtime
from .monitor import Monitors
from .sampler import distributed_loader


class DeepSpeedAccessors:
    """The read-only half of DeepSpeed's engine API (see the module)."""

    @property
    def monitor(self) -> Monitors:
        """DeepSpeed's ``engine.monitor``: ``engine.monitor.write_events([(name, value, step)])``."""
        return self.reporting.monitors

    @property
    def optimizer(self) -> Optional[ZeroOptimizer]:
        """The ZeRO optimizer (None for an engine built without one); ``zero`` is the same object."""
        return self._optimizer

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
        self.stack.settle()  # the gradients and master weights are a step's running behind until it is done
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
        return self.mesh.context.ledger

    def was_step_applied(self) -> bool:
        return self._step_applied

    def get_lr(self) -> list[float]:
        return self.stack.learning_rates()

    def get_mom(self) -> list:
        """Each parameter group's momentum as DeepSpeed reports it: Adam's ``betas``, else SGD's ``momentum``."""
        if self._optimizer is None:
            return []
        return [g["betas"] if "betas" in g else g.get("momentum") for g in self._optimizer.param_groups]

    def steps_per_print(self) -> int:
        return self.settings.steps_per_print

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
        return {name: 1000.0 * seconds for name, seconds in self.reporting.timers.items()}

    def print_forward_breakdown(self, fwd_time: float) -> None:
        """DeepSpeed prints its MoE layers' forward times here (their gating and all-to-alls); zeroshard times no
        phase inside the forward, so the forward's alone."""
        log_rank0(f"time (ms) | fwd: {fwd_time:.2f}")

    def curriculum_learning_enabled(self) -> bool:
        return False  # the data-efficiency library is refused by the config

    def random_ltd_enabled(self) -> bool:
        return False  # likewise

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
        return self.mesh.world.size

    @property
    def dp_world_size(self) -> int:
        """Data-parallel ranks: the world over the tensor- and sequence-parallel degrees (DeepSpeed's attribute)."""
        return self.mesh.data_parallel_size

    @property
    def sequence_parallel_size(self) -> int:
        """Ranks of a sequence-parallel group (1: none), as ``sequence_parallel_size`` or the ``mpu`` set it."""
        return self.mesh.sequence.size

    @property
    def seq_dp_world_size(self) -> int:
        """The ranks ZeRO shards and reduces over: data x sequence (DeepSpeed's attribute)."""
        return self.mesh.gradient.size

    def autotp_size(self) -> int:
        """Ranks of a tensor-parallel group (1: none), as ``tensor_parallel.autotp_size`` or ``tp_model_init`` set."""
        return self.mesh.tensor.size

    def is_deepcompile_enabled(self) -> bool:
        """The config's ``compile.deepcompile`` (DeepSpeed's call)."""
        return self.settings.compile.deepcompile

    def is_deepcompile_active(self) -> bool:
        """Whether ``engine.compile()`` ran with ``compile.deepcompile`` set: the units compiled with zeroshard's
        gathers, prefetches and reductions between them (what DeepCompile's passes do; clients check it after
        compiling)."""
        return self.settings.compile.deepcompile and self.compiled is not None

    def memory_breakdown(self) -> dict[str, list[dict[str, int]]]:
        """Model-state bytes by category (parameters, gradients, optimizer state, communication buffers,
        gathered units; and per location) at start and at the largest sample, for every rank: a collective.
        Samples are taken after forward, backward and the step while a report is to come (until the first
        ``steps_per_print`` report, or throughout with ``memory_breakdown: true``)."""
        return self.reporting.memory_breakdown()

    def state_bytes(self) -> dict[str, int]:
        """Model-state bytes held by this rank (parameters, master weights, gradient shards, optimizer state)."""
        return self.stack.state_bytes()

    def state_bytes_by_location(self) -> dict[str, dict[str, int]]:
        """The same, split by where it lives: ``device``, ``host`` (offloaded) and ``nvme`` (swap files)."""
        return self.stack.state_bytes_by_location()

    def exposed_wait(self) -> dict[str, float]:
        """Seconds the training thread waited, by kind of transfer, since ``initialize`` (or the last
        ``comm_ledger.reset()`` for the collectives): each collective op (``all_gather``, ``reduce_scatter``,
        ``all_reduce``, ``broadcast``, ``send`` / ``recv`` between pipeline stages, ...: the time spent issuing it and
        waiting for a result not there yet; one that finished behind computation costs nothing), NVMe reads and
        writes of offloaded state (``nvme_read``, ``nvme_write``) and the optimizer step running behind the forward
        (``step_behind``). Measured on the host: on a GPU, a collective the host does not wait for (NCCL's, ordered
        on streams) shows only its issue time. This is what says which transfer to hide next."""
        return self.reporting.exposed_wait()

    def disk_io(self) -> dict[str, float]:
        """What this rank's offload swap files moved since ``initialize``: bytes ``read`` and ``written``;
        ``wait_s``, the seconds training waited for them (transfers that finished behind computation cost none);
        ``read_s`` / ``write_s``, the seconds the I/O threads spent transferring (bytes over them: the bandwidth
        the disk gave this run); ``behind_wait_s``, the seconds training waited for optimizer steps running behind
        the forward (``zeroshard.zero.step_behind``), whose own transfers are not in ``wait_s``. A step still running
        is finished first, so the counts are whole steps'."""
        self.stack.settle()
        return self.stack.disk_io()

    def deepspeed_io(
        self,
        dataset: Dataset,
        batch_size: Optional[int] = None,
        route: str = "train",
        pin_memory: bool = True,
        data_sampler: Optional[Sampler] = None,
        collate_fn: Optional[Callable] = None,
        num_local_io_workers: Optional[int] = None,
    ) -> DataLoader:
        """DeepSpeed's loader of ``dataset`` for this rank: the micro-batch size, this rank's share of the
        data-parallel ranks' samples, shuffled for ``route="train"`` and in order for ``"eval"`` / ``"predict"`` (as
        DeepSpeed's), ``initialize``'s collate function unless given one; pinned only where there is a device to
        copy to. ``num_local_io_workers`` None is 0 here (DeepSpeed starts two loader processes per device)."""
        if not isinstance(dataset, Dataset):
            raise ValueError(f"deepspeed_io: training data must be a torch Dataset, got {type(dataset).__name__}")
        if route not in ("train", "eval", "predict"):
            raise ValueError(f"deepspeed_io(route={route!r}): 'train', 'eval' or 'predict'")
        batch_size = self.train_micro_batch_size_per_gpu() if batch_size is None else batch_size
        for name, value, least in (("batch_size", batch_size, 1), ("num_local_io_workers", num_local_io_workers, 0)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
                raise ValueError(f"deepspeed_io({name}={value!r}): an int >= {least}")
        return distributed_loader(
            dataset,
            batch_size,
            self.mesh.batch.size,
            self.mesh.batch.rank,
            shuffle=route == "train",
            drop_last=self.settings.dataloader_drop_last,
            collate_fn=collate_fn if collate_fn is not None else self.collate_fn,
            sampler=data_sampler,
            pin_memory=pin_memory and get_accelerator().can_pin_memory,
            num_workers=num_local_io_workers or 0,
        )
