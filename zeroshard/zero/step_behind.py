"""The offloaded optimizer step, run behind the next forward.

With ``offload_optimizer`` at stage 3 the step is the slow part of an iteration: it streams every sub-group's master
weights and moments through host memory (from the swap file under NVMe) while the compute device idles. Its result
is needed by the next forward only unit by unit, so the step can run on a worker thread while that forward runs:
each flat group's shard is published as soon as its sub-groups are stepped (in the order the forward gathers them),
and a gather of a flat group that is still being updated waits for that flat group alone
(:meth:`FlatGroup.await_update`). The arithmetic is the synchronous step's, operation for operation: the gradient
norm, the overflow verdict and the clip coefficient are known before the step starts (no speculation, nothing to
roll back), and the step reads the hyperparameters as they were when it started (:func:`frozen_groups`), so a
learning-rate scheduler stepping right after ``engine.step()`` changes the next step, not this one.

What may not run behind: a flat group whose publish is a collective (a resident group's all-gather; collectives
are issued from the training thread only) is stepped before the rest start, synchronously. Shards kept on NVMe run
behind too: both threads stage them through the one buffer pool and submit to the one swap file, which runs requests
in the order they were submitted, and a shard is published only once its write is (for an fp32 shard that is its
own master, once the optimizer's write of the master is submitted: :meth:`NvmeOptimizerSwapper.steps`' ``written``).
Anything else that reads or writes the optimizer state (a checkpoint, a backward, the next step, ``GatheredParameters``)
first waits for the step (:meth:`StepBehind.wait`); a failure inside it is raised there, naming the rank and the
step.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

import torch

from ..offload import hidden_waits
from .flat_group import FlatGroup


class StepBehindError(RuntimeError):
    """The optimizer step that ran behind the forward failed."""


def frozen_groups(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A second handle on ``optimizer`` (the same class, state and parameters) whose parameter groups are copies of
    its hyperparameters now: a step through it is unaffected by later changes to ``optimizer.param_groups``."""
    frozen = second_handle(optimizer)
    if "step" in optimizer.__dict__:  # a torch LR scheduler's wrapper: the flag it sets when the optimizer steps
        optimizer._opt_called = True
    frozen.param_groups = [dict(group) for group in optimizer.param_groups]
    return frozen


def second_handle(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Another object of ``optimizer``'s class sharing its attributes (state, groups, hooks), whose ``step`` is the
    class's own: a torch LR scheduler bound to a client's optimizer wraps its ``step`` on the instance, and that
    wrapper would step the original."""
    handle = object.__new__(type(optimizer))
    handle.__dict__.update(optimizer.__dict__)
    handle.__dict__.pop("step", None)
    return handle


class _Publish(Future):
    """One flat group's update by a step running behind; the training thread's wait on it is counted."""

    def __init__(self, behind: "StepBehind"):
        super().__init__()
        self._behind = behind

    def result(self, timeout=None):
        started = time.perf_counter()
        try:
            return super().result(timeout)
        finally:
            self._behind.waited_s += time.perf_counter() - started


class StepBehind:
    """One worker thread running at most one optimizer step at a time, and the training thread's wait for it."""

    def __init__(self, rank: int):
        self.rank = rank
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="zeroshard-step")
        self._running: Optional[Future] = None
        self.waited_s = 0.0  # how long the training thread waited for steps running behind (the exposed part)

    @property
    def running(self) -> bool:
        return self._running is not None

    def launch(self, label: str, work: Callable[[], None], flats: list[FlatGroup]) -> None:
        """Run ``work`` (which publishes ``flats``, each with ``FlatGroup.finish_publish``) on the worker; a read
        of one of ``flats`` waits until it is published."""
        self.wait()
        for flat in flats:
            flat.expect_update(_Publish(self))
        self._running = self._worker.submit(self._run, label, work, flats)

    def _run(self, label: str, work: Callable[[], None], flats: list[FlatGroup]) -> None:
        error: Optional[StepBehindError] = None
        try:
            with hidden_waits():
                work()
        except BaseException as failure:
            error = StepBehindError(f"rank {self.rank}: {label}, running behind the next forward, failed: {failure}")
            raise error from failure
        finally:
            for flat in flats:  # never leave a reader waiting: the unpublished ones fail with the step's error
                flat.finish_update(error)

    def wait(self) -> None:
        """Return once no step is running; raise the error of one that failed."""
        if self._running is None:
            return
        running, self._running = self._running, None
        started = time.perf_counter()
        error = running.exception()
        self.waited_s += time.perf_counter() - started
        if error is not None:
            raise error

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._worker.shutdown(wait=True)
