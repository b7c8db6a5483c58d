"""The offloaded optimizer step run during backward, before its verdict: speculate, then commit or replay.

An offloaded step (``offload_optimizer`` cpu or nvme) reads and writes every sub-group's master weights and moments
through host memory or the swap file. It needs the gradient norm (for clipping) and the overflow verdict, which exist
only once the last gradient is reduced; waiting for them leaves the disk idle through backward. Instead, as soon as a
flat group's reduced gradient is final (the step's last micro-batch), its sub-groups are stepped on a worker thread,
*speculating* that the step applies unclipped: the gradient times ``1 / loss_scale``, nothing skipped. The result
goes to a shadow slot (a second host buffer; on NVMe, a twin region of the swap file), never over the state it was
computed from. After backward the step's verdict decides (Note [exact speculation]):

- **commit**: the gradients are finite, clipping did not clip (``gradient_clipping`` 0, or the norm at most the
  clip), the loss scale and the hyperparameters are those the speculation used, and no gradient or state was written
  since: the shadow slots become current and the parameters are published. The arithmetic was the synchronous
  step's, operation for operation (the same coefficient, the same sub-groups, the same kernels): the result is the
  same bits.
- **replay**: anything else. The shadows are dropped (the state they came from is untouched: nothing is inverted,
  unlike DeepSpeed's SuperOffload, whose rollback recomputes the old moments from the new ones in floating point and
  gets them back only approximately) and the step runs as it always did: clipped, or skipped.

A run that clips every step would replay every step: :class:`SpeculationPolicy` speculates while most recent verdicts
committed (or would have), an average of them that stops it after a few replays and starts it again after a few
clean steps. What speculation did is counted per step in
:class:`SpeculationStats` (``engine.disk_io()``, the step report).

The home (:mod:`.offloaded_state`) does the stepping into shadows, the commit and the discard; this module owns the
worker, the per-step bookkeeping and the policy.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ..offload import hidden_waits
from .step_behind import frozen_groups

# the policy's memory: each step's verdict moves the clean rate this far towards 1 (clean) or 0 (not)
RATE_STEP = 0.25
# speculate while the clean rate is at least this: a commit saves about what a replay wastes (the speculated
# transfers ran beside backward; the step after the verdict is what would have run anyway)
RATE_FLOOR = 0.5


class SpeculationPolicy:
    """When to speculate (pure): while the rate of steps whose verdict commits (or would have: finite and not
    clipped, known on every step, speculated or not) is at least :data:`RATE_FLOOR`. The rate is an exponential
    average that starts at 1 and moves :data:`RATE_STEP` of the way to each verdict. A run that clips on every step
    replays 3 times and then never speculates; one that stopped starts again after 3 clean steps in a row; one
    that clips on 1 step in 10 at random speculates on 99% of its steps and replays about 1 in 10 of them
    (``tests/unit/zero/test_speculation.py`` measures each over 10000 steps)."""

    def __init__(self, rate_step: float = RATE_STEP, floor: float = RATE_FLOOR):
        self.rate_step, self.floor = rate_step, floor
        self.clean_rate = 1.0

    @property
    def speculating(self) -> bool:
        return self.clean_rate >= self.floor

    def record(self, speculated: bool, clean: bool) -> None:
        """The verdict of one step: whether it was speculated, and whether it was (or would have been) clean."""
        self.clean_rate += self.rate_step * (float(clean) - self.clean_rate)


def would_commit(norm: float, clip: float) -> bool:
    """The verdict on the gradients alone: finite, and not clipped (``clip`` 0: no clipping)."""
    return math.isfinite(norm) and not (clip > 0 and norm > clip)


@dataclass
class SpeculationStats:
    """Sub-groups speculated, committed and replayed, what the replays cost, and the training thread's wait for the
    speculated steps at the verdict; so far, and for the last step (``last_*``)."""

    speculated: int = 0
    committed: int = 0
    replayed: int = 0
    replay_bytes: int = 0  # bytes of optimizer state the replayed sub-groups stepped again (read + written)
    wait_s: float = 0.0
    last_speculated: int = 0
    last_committed: int = 0
    last_replayed: int = 0
    last_replay_bytes: int = 0


@dataclass
class _Armed:
    """What a step's speculation assumed: the coefficient, the loss scale, the hyperparameters (a frozen handle on
    the optimizer, and their values to compare at the verdict)."""

    coef: float
    scale: float
    optimizer: torch.optim.Optimizer
    groups: list[dict]
    offered: set = field(default_factory=set)
    spoiled: bool = False  # a flat group's gradient became final twice (a second backward): replay


def _hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def _same(a: list[dict], b: list[dict]) -> bool:
    if len(a) != len(b) or any(x.keys() != y.keys() for x, y in zip(a, b)):
        return False
    for x, y in zip(a, b):
        for key in x:
            u, v = x[key], y[key]
            if torch.is_tensor(u) or torch.is_tensor(v):
                if not (torch.is_tensor(u) and torch.is_tensor(v) and torch.equal(u, v)):
                    return False
            elif u != v and not (isinstance(u, float) and isinstance(v, float) and math.isnan(u) and math.isnan(v)):
                return False
    return True


# Stepping one flat group into its shadows: (flat index, coefficient, optimizer handle) -> sub-groups stepped, or
# None when the home has no room for its shadows (it is then stepped after the verdict).
SpeculateFlat = Callable[[int, float, torch.optim.Optimizer], Optional[int]]


class Speculation:
    """The worker stepping flat groups as their gradients become final, and one step's speculation from ``arm`` to
    ``resolve`` (see the module docstring). ``cores_share``: the share of the CPU's cores the worker's kernels use
    (DeepSpeed's ``cpuadam_cores_perc``); the training thread keeps the others."""

    def __init__(self, rank: int, speculate: SpeculateFlat, cores_share: float, policy: SpeculationPolicy):
        self.rank = rank
        self._speculate = speculate
        self.policy = policy
        threads = max(1, int(torch.get_num_threads() * cores_share))
        self._worker = ThreadPoolExecutor(
            1, thread_name_prefix="zeroshard-speculate", initializer=torch.set_num_threads, initargs=(threads,)
        )
        self._armed: Optional[_Armed] = None
        self._jobs: list[tuple[int, Future]] = []
        self._done: dict[int, int] = {}  # flat index -> sub-groups speculated into shadows, awaiting the verdict
        # flat groups whose gradient changes after backward: pipeline ties, summed over the stages in the step
        self.excluded: set[int] = set()
        self.stats = SpeculationStats()

    @property
    def armed(self) -> bool:
        return self._armed is not None

    def arm(self, scale: float, optimizer: torch.optim.Optimizer) -> None:
        """Before the backward that ends an accumulation: speculate this step if the policy says so."""
        if self.policy.speculating and not self._jobs and not self._done:
            self._armed = _Armed(1.0 / scale, scale, frozen_groups(optimizer), _hyperparameters(optimizer))

    def offer(self, index: int) -> None:
        """Flat group ``index``'s gradient is final: step it into its shadows on the worker."""
        if self._armed is not None and index not in self.excluded:
            armed = self._armed
            if index in armed.offered:
                armed.spoiled = True
                return
            armed.offered.add(index)
            self._jobs.append((index, self._worker.submit(self._run, index, armed.coef, armed.optimizer)))

    def _run(self, index: int, coef: float, optimizer: torch.optim.Optimizer) -> Optional[int]:
        with hidden_waits():
            return self._speculate(index, coef, optimizer)

    def wait(self) -> None:
        """Wait for the speculated steps (the training thread's wait is counted). The first failure is raised as
        itself (an ``OffloadIOError`` stays one), with a note naming the rank and the flat group; the speculation
        is then void (the caller discards what :meth:`abandon` returns)."""
        started = time.perf_counter()
        jobs, self._jobs = self._jobs, []
        failure: Optional[BaseException] = None
        for index, job in jobs:
            error = job.exception()
            if error is not None and failure is None:
                failure = error
                failure.add_note(
                    f"rank {self.rank}: in the optimizer step speculated during backward (super_offload), flat "
                    f"group {index}; the state it read is untouched"
                )
            elif error is None and job.result() is not None:
                self._done[index] = job.result()
        self.stats.wait_s += time.perf_counter() - started
        if failure is not None:
            self._armed = None
            raise failure

    def resolve(
        self, clean: bool, scale: float, optimizer: torch.optim.Optimizer, step_bytes: Callable[[int], int]
    ) -> tuple[dict[int, int], bool]:
        """The verdict (``clean``: on the gradients alone, :func:`would_commit`): the flat groups speculated (with
        their sub-group counts), and whether to commit them (else they are replayed: the caller discards them and
        steps as without speculation). The policy and the counts are updated here (``step_bytes(index)``: what one
        step of a flat group reads and writes, the cost of its replay)."""
        self.wait()
        armed, self._armed = self._armed, None
        done, self._done = self._done, {}
        speculated = armed is not None
        if speculated:
            same = scale == armed.scale and _same(armed.groups, _hyperparameters(optimizer))
            clean = clean and same and not armed.spoiled
        self.policy.record(speculated, clean)
        stats = self.stats
        stats.last_speculated = sum(done.values())
        stats.last_committed = stats.last_speculated if clean else 0
        stats.last_replayed = 0 if clean else stats.last_speculated
        stats.last_replay_bytes = 0 if clean else sum(step_bytes(index) for index in done)
        stats.speculated += stats.last_speculated
        stats.committed += stats.last_committed
        stats.replayed += stats.last_replayed
        stats.replay_bytes += stats.last_replay_bytes
        return done, clean and bool(done)

    def abandon(self) -> dict[int, int]:
        """A gradient, master weight or state was written after the speculation read it (``safe_set_full_grad``, a
        checkpoint load, ``zero_grad`` before the step): wait for the speculated steps and return them all, to be
        discarded; the step will run as the synchronous one."""
        if self._armed is None and not self._jobs and not self._done:
            return {}
        self._armed = None
        try:
            self.wait()
        finally:
            done, self._done = self._done, {}
        return done

    def close(self) -> None:
        try:
            for _, job in self._jobs:
                job.exception()
        finally:
            self._worker.shutdown(wait=True)
