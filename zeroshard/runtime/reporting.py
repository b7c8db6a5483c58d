"""What an engine measures and prints about its training, apart from the loop that trains.

One :class:`Reporting` per engine: phase timers (``wall_clock_breakdown``), samples and tokens per second between
``steps_per_print`` lines, the monitors (TensorBoard, W&B, CSV), model-state memory samples, DeepSpeed's flops
profiler (rank 0 profiles one forward of ``flops_profiler.profile_step``) and the communication lines
(``comms_logger``, 1-bit totals) and the exposed wait: the seconds the training thread waited per kind of transfer
(collectives by op, NVMe reads and writes, the step running behind), per step in the report line and the monitors.
The loop tells it what happened; it decides what to measure and print.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Optional

import torch
from torch.utils._pytree import tree_flatten

from .. import comm
from ..accelerator import get_accelerator
from ..checkpoint.view import TrainingCounters
from ..config import BatchTriad
from ..log import log_rank0
from ..profiling import FlopsProfiler
from ..zero import ZeroStack
from .compiling import CompiledRegions
from .memory import MemoryTracker, format_table
from .monitor import Monitors


class Reporting:
    """The engine's timers, throughput window, monitors, memory samples and flops profile (see the module)."""

    def __init__(
        self,
        settings,
        module: torch.nn.Module,
        stack: ZeroStack,
        mesh: comm.Mesh,
        counters: TrainingCounters,
        batch: BatchTriad,
    ):
        self.settings, self.stack, self.mesh, self.counters, self.batch = settings, stack, mesh, counters, batch
        self.timers: dict[str, float] = defaultdict(float)  # seconds per phase since the last report
        self._window_start = time.perf_counter()
        self._window_tokens = 0
        self._memory_reported = False
        self._disk_seen = stack.disk_io()  # the swap files' counters at the last report
        self._waits_at_step: dict[str, float] = {}  # exposed_wait() after the last optimizer step
        self._waits_at_report: dict[str, float] = {}  # and at the last report line
        # model-state bytes are sampled (a walk over every owner) only while a report is to come: until the
        # first steps_per_print line prints the table, or throughout with memory_breakdown: true
        self.sampling_memory = bool(settings.steps_per_print) or settings.memory_breakdown
        self.monitors = Monitors(settings, comm.get_rank())
        self.memory = MemoryTracker()
        self.sample_memory(always=True)
        if settings.comms_logger.enabled:
            mesh.context.timing = True  # this engine's collectives only
            mesh.context.by_caller = settings.comms_logger.debug
            if settings.comms_logger.verbose and comm.get_rank() == 0:
                mesh.context.each_op = _print_op
        block = settings.flops_profiler
        self.flops_profiler = (
            FlopsProfiler(module, recompute_fwd_factor=block.recompute_fwd_factor)
            if block.enabled and comm.get_rank() == 0
            else None
        )
        self._profile_started: Optional[float] = None
        self.compiled: Optional[CompiledRegions] = None  # engine.compile()'s regions, once it ran

    def count_tokens(self, inputs) -> None:
        """Count the forward's tokens: the first integer tensor of its inputs (token ids: batch x sequence)."""
        tokens = next((t for t in tree_flatten(inputs)[0] if torch.is_tensor(t) and not t.is_floating_point()), None)
        self._window_tokens += tokens.numel() if tokens is not None else 0

    @contextlib.contextmanager
    def forward(self, started: float):
        """Around one forward: the flops profile of the profiled step's first forward, the forward timer and a
        memory sample."""
        profiling = (
            self.flops_profiler is not None
            and self._profile_started is None
            and self.counters.global_steps == self.settings.flops_profiler.profile_step
        )
        if profiling:
            self._profile_started = started
            self.flops_profiler.start_profile()
        yield
        if profiling:
            self.flops_profiler.stop_profile()
        self.timers["forward"] += time.perf_counter() - started
        self.sample_memory()

    def sample_memory(self, always: bool = False) -> None:
        if always or self.sampling_memory:
            self.memory.sample(self.stack.state_bytes_by_location(), get_accelerator().max_memory_allocated())

    def memory_breakdown(self) -> dict[str, list[dict[str, int]]]:
        """Every rank's model-state bytes at start and at the largest sample (a collective)."""
        return self.memory.all_ranks(self.mesh.world)

    def print_flops_profile(self) -> None:
        """After the profiled step: print its profile (DeepSpeed's report) and stop profiling."""
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

    def exposed_wait(self) -> dict[str, float]:
        """Seconds the training thread waited per kind of transfer so far (``engine.exposed_wait``)."""
        waits = self.mesh.context.ledger.waited_by_op()
        io = self.stack.disk_io()
        waits.update(nvme_read=io["read_wait_s"], nvme_write=io["write_wait_s"], step_behind=io["behind_wait_s"],
                     speculation=io["speculation_wait_s"])  # fmt: skip
        return {kind: seconds for kind, seconds in waits.items() if seconds > 0}

    def _waits_since(self, before: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
        """(the exposed wait per kind since ``before``, the counts now); a ledger reset in between counts from 0."""
        now = self.exposed_wait()
        return {k: v - before.get(k, 0.0) if v >= before.get(k, 0.0) else v for k, v in now.items()}, now

    def step_taken(self, last_loss: Optional[torch.Tensor]) -> bool:
        """After an optimizer step (applied or skipped): the monitors' events; True every ``steps_per_print`` steps,
        when the report line is due (:meth:`report`, which the engine's ``_report_progress`` calls). ``last_loss`` is
        read (a device sync) only when one of them needs it."""
        self.sample_memory()
        if self.monitors.enabled:
            samples = self.counters.global_samples
            waits, self._waits_at_step = self._waits_since(self._waits_at_step)
            self.monitors.write(
                [
                    ("Train/Samples/train_loss", _value(last_loss), samples),
                    ("Train/Samples/lr", self.stack.learning_rates()[0], samples),
                    ("Train/Samples/loss_scale", self.stack.loss_scale, samples),
                    ("Train/Samples/grad_norm", self.stack.global_grad_norm, samples),
                    *(
                        (f"Train/Samples/exposed_wait/{kind}", seconds, samples)
                        for kind, seconds in sorted(waits.items())
                    ),
                ]
            )
        every = self.settings.steps_per_print
        return bool(every) and self.counters.global_steps % every == 0

    def report(self, last_loss: Optional[torch.Tensor]) -> None:
        """The report line of the last ``steps_per_print`` steps."""
        loss = _value(last_loss)
        elapsed = time.perf_counter() - self._window_start
        samples = self.settings.steps_per_print * self.batch.train_batch_size
        norm = self.stack.global_grad_norm
        clip = self.settings.gradient_clipping
        clipped = min(norm, clip) if clip > 0 and norm is not None else norm
        tokens = self._window_tokens * self.mesh.gradient.size  # every rank of the gradient group ran other tokens
        ledger = self.mesh.context.ledger
        log_rank0(
            f"step {self.counters.global_steps}: loss {loss:.4f} lr {self.stack.learning_rates()[0]:.3e} "
            f"loss_scale {self.stack.loss_scale:g} grad_norm {norm:.4f} (clipped {clipped:.4f}) "
            f"samples/s {samples / elapsed:.1f} tokens/s {tokens / elapsed:.0f} skipped {self.counters.skipped_steps}"
        )
        if self.settings.wall_clock_breakdown:
            if self.stack.stage3 is not None:
                self.timers["gather_wait"] = self.stack.take_gather_seconds()
            log_rank0("time (s) " + " ".join(f"{k} {v:.3f}" for k, v in sorted(self.timers.items())))
        waits, self._waits_at_report = self._waits_since(self._waits_at_report)
        if waits:  # what the training thread waited for, per step of the window (rank 0's)
            steps, total = self.settings.steps_per_print, sum(waits.values())
            log_rank0(
                f"exposed wait per step: {total / steps:.4f} s ({100 * total / elapsed:.1f}% of the step): "
                + ", ".join(
                    f"{kind} {seconds / steps:.4f}" for kind, seconds in sorted(waits.items(), key=lambda i: -i[1])
                )
            )
        if self.compiled is not None:
            log_rank0(self.compiled.report())
        if self.settings.comms_logger.enabled:
            log_rank0(ledger.format())
        self._report_disk()
        compressed = {op: t for (op, _), t in ledger.totals.items() if op.endswith("_1bit")}
        if compressed:  # a 1-bit optimizer past its warm-up: what the compressed collectives sent so far
            log_rank0(
                "1-bit communication since start: "
                + ", ".join(f"{op} {t.calls} calls {t.wire_bytes / 1e6:.3f} MB sent" for op, t in compressed.items())
                + f"; all collectives {ledger.total_wire_bytes() / 1e6:.3f} MB sent"
            )
        # the model-state memory of every rank at start and at its peak: once, or every report with memory_breakdown
        if not self._memory_reported or self.settings.memory_breakdown:
            self._memory_reported = True
            log_rank0(format_table(self.memory_breakdown()))
            self.sampling_memory = self.settings.memory_breakdown
        self.timers.clear()
        self._window_tokens = 0
        self._window_start = time.perf_counter()

    def _report_disk(self) -> None:
        """Offload: what the optimizer step during backward did since the last report (speculated, committed,
        replayed), and, to NVMe, what the swap files moved per step, at what bandwidth, and how long training waited
        for it (rank 0's)."""
        now = self.stack.disk_io()
        last, self._disk_seen = self._disk_seen, now
        moved = {k: now[k] - last.get(k, 0) for k in now}
        steps = self.settings.steps_per_print
        if moved["speculated"]:
            log_rank0(
                f"optimizer step during backward (rank 0): {moved['speculated']} sub-groups speculated in "
                f"{steps} steps, {moved['committed']} committed, {moved['replayed']} replayed "
                f"({moved['replay_bytes'] / 1e9:.3f} GB of state stepped again); training waited "
                f"{moved['speculation_wait_s'] / steps:.3f} s per step for it"
            )
        if not (moved["read"] or moved["written"]):
            return

        def rate(nbytes, seconds):
            return f"{nbytes / seconds / 1e9:.2f} GB/s" if seconds else "-"

        log_rank0(
            f"offload disk (rank 0): {moved['read'] / steps / 1e9:.3f} GB read + {moved['written'] / steps / 1e9:.3f} "
            f"GB written per step, at {rate(moved['read'], moved['read_s'])} / "
            f"{rate(moved['written'], moved['write_s'])}; training waited {moved['wait_s'] / steps:.3f} s per step "
            f"for the disk, {moved['behind_wait_s'] / steps:.3f} s for the step running behind the forward"
        )

    def close(self) -> None:
        self.monitors.close()


def _value(loss: Optional[torch.Tensor]) -> Optional[float]:
    """The last micro-batch's loss as a number (a device sync: only when logging or monitoring)."""
    return None if loss is None else loss.float().item()


def _print_op(op: str, group: str, nbytes: int, wire_bytes: float, seconds: float) -> None:
    """``comms_logger.verbose``: one line per collective as it completes (rank 0), as DeepSpeed's logger prints."""
    algbw, busbw = (nbytes / seconds / 1e9, wire_bytes / seconds / 1e9) if seconds > 0 else (0.0, 0.0)
    log_rank0(
        f"comm op: {op} on '{group}' | time (ms): {seconds * 1e3:.2f} | msg size: {nbytes / 1e6:.3f} MB | "
        f"algbw (GB/s): {algbw:.3f} | busbw (GB/s): {busbw:.3f}"
    )
