"""Run a function on N real processes joined by a Gloo process group (file store), as tests and users need.

``run_distributed(fn, world_size, *args)`` spawns the ranks, returns each rank's return value, and
turns a crash into an error naming the rank and a hang into an error naming the ranks that never
finished (after killing every worker).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable


class WorkerError(RuntimeError):
    """A rank raised; the message carries its rank and traceback."""


class WorkerHang(TimeoutError):
    """Some ranks did not finish in time; the message names them."""


def _worker(
    fn: Callable,
    rank: int,
    world_size: int,
    store: str,
    out_dir: str,
    comm_timeout_s: float,
    environ: dict[str, str],
    args: tuple,
    join: bool = True,
) -> None:
    os.environ.clear()  # the caller's environment now, as a spawned process would get it (not the server's)
    os.environ.update(environ)
    if join:  # a rank of the harness's group; otherwise a plain process, as `python script.py` starts one
        os.environ.update(
            {
                "RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": str(rank),
                "ZEROSHARD_ACCELERATOR": environ.get("ZEROSHARD_ACCELERATOR", "cpu"),
            }
        )
    import torch

    from .. import comm
    from ..log import log_to_stdout

    torch.set_num_threads(RANK_THREADS)
    if join:
        log_to_stdout()  # a rank's lines go to its stdout, as under the launcher
    result_path = Path(out_dir) / f"rank{rank}.pkl"
    try:
        if join:
            comm.init_distributed(
                init_method=f"file://{store}",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=comm_timeout_s),
            )
        (Path(out_dir) / f"rank{rank}.started").touch()
        value = fn(*args)
        payload = ("ok", value)
    except BaseException:  # report everything, including KeyboardInterrupt, to the parent
        payload = ("error", traceback.format_exc())
    with open(result_path, "wb") as f:
        pickle.dump(payload, f)
    try:
        comm.destroy(announce=payload[0] == "ok")
    except Exception:
        pass


RANK_THREADS = 1  # ranks share the machine's cores; the parity references use the same count (see parity.py)

# Note [ranks forked from a preloaded server]: a spawned rank spends ~5 s of CPU importing torch and
# torch._dynamo (which the first optimizer imports), and ~2 s more importing zeroshard's engine and transformers'
# modeling code, before it runs a line of the test; over a suite's hundreds of ranks that is most of its time on a
# small machine (preloading zeroshard and transformers too took two test files from 96 to 61 s). The ranks are forked
# from multiprocessing's fork server, which imports these once (a module that is not installed is skipped). Like
# spawned ranks, they start from a process that never ran a collective or touched a GPU (none of these modules does
# at import), get the caller's current environment and sys.path, and have fn and args pickled to them. What a
# forked rank does not have is a user's process's memory: it maps every preloaded module (transformers adds 40 MiB
# to a rank training a plain torch model), so whatever measures a process's memory as a whole (`zeroshard estimate`
# against the peak RSS, a benchmark's peak) runs with `fresh_interpreters=True`, each rank importing what it uses.
_PRELOADED = ["torch", "torch._dynamo", "torch.distributed.nn", "zeroshard.runtime", "transformers.modeling_utils"]


def _start_method(fresh: bool = False) -> mp.context.BaseContext:
    if fresh or "forkserver" not in mp.get_all_start_methods():  # a fresh interpreter each; Windows has no other
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(_PRELOADED)
    return context


def _collect(tmp: str, procs: list, hung: list[int]) -> tuple[list[Any], list[str]]:
    """Each rank's result (None where it has none) and the errors: a rank's exception, or an exit without result."""
    results, errors = [], []
    for rank, proc in enumerate(procs):
        payload = _read(tmp, rank)
        if payload is None:
            if rank not in hung:
                errors.append(f"rank {rank} exited with code {proc.exitcode} and no result")
            results.append(None)
        elif payload[0] == "error":
            errors.append(f"rank {rank} failed:\n{payload[1]}")
            results.append(None)
        else:
            results.append(payload[1])
    return results, errors


def run_distributed(
    fn: Callable,
    world_size: int,
    *args: Any,
    timeout_s: float = 240.0,
    comm_timeout_s: float = 60.0,
    env: dict[str, str] | None = None,
    start_timeout_s: float = 600.0,
    join_process_group: bool = True,
    fresh_interpreters: bool = False,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` spawned ranks; return the per-rank results in rank order.

    ``fn`` must be importable (module level) and its results picklable (CPU tensors are fine). ``timeout_s``
    counts from the moment every rank has joined the process group: spawning and importing torch take
    seconds to minutes on a loaded machine and are bounded separately by ``start_timeout_s``. Without
    ``join_process_group`` each process runs ``fn`` as a plain process would (no process group, no ``RANK`` /
    ``WORLD_SIZE``: a script that sets up what it needs, as ``python script.py`` runs it), forked from the same
    preloaded server. ``fresh_interpreters``: each rank a new interpreter importing everything itself
    (multiprocessing's spawn), as a launched rank is, for what depends on the process as a whole (its peak memory),
    at the cost of the imports the fork server saves.
    """
    ctx = _start_method(fresh_interpreters)
    environ = {**os.environ, **(env or {})}
    with tempfile.TemporaryDirectory(prefix="zeroshard-test-") as tmp:
        store = os.path.join(tmp, "store")
        joined = join_process_group
        rank_args = [(fn, r, world_size, store, tmp, comm_timeout_s, environ, args, joined) for r in range(world_size)]
        procs = [ctx.Process(target=_worker, args=one, daemon=True) for one in rank_args]
        for p in procs:
            p.start()
        started = _wait(procs, tmp, start_timeout_s, timeout_s, comm_timeout_s)
        hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        results, errors = _collect(tmp, procs, hung)
        if errors:
            suffix = f"\n(ranks {hung} were still running and were killed)" if hung else ""
            raise WorkerError("\n".join(errors) + suffix)
        if hung and not started:
            raise WorkerHang(
                f"ranks {hung} of {world_size} did not start within {start_timeout_s:.0f}s and were killed"
            )
        if hung:
            raise WorkerHang(f"ranks {hung} of {world_size} did not finish within {timeout_s:.0f}s and were killed")
        return results


def _wait(procs: list, tmp: str, start_timeout_s: float, timeout_s: float, comm_timeout_s: float) -> bool:
    """Wait until every rank has exited, one failed (then briefly for the others to fail on their own: their errors
    name the op), or the time is up; returns whether every rank started (joined its process group)."""
    deadline = time.monotonic() + start_timeout_s + timeout_s
    started = False
    failed_early = None
    while time.monotonic() < deadline and any(p.is_alive() for p in procs):
        if not started and all((Path(tmp) / f"rank{r}.started").exists() for r in range(len(procs))):
            started, deadline = True, time.monotonic() + timeout_s
        for rank, p in enumerate(procs):
            if not p.is_alive() and failed_early is None:
                payload = _read(tmp, rank)
                if payload is None or payload[0] == "error":
                    failed_early = rank
        if failed_early is not None:
            grace = time.monotonic() + min(comm_timeout_s + 10, 30)
            while time.monotonic() < grace and any(p.is_alive() for p in procs):
                time.sleep(0.1)
            break
        time.sleep(0.05)
    return started


def _read(tmp: str, rank: int):
    """A worker's result. Unpickled on purpose (results are any picklable value, as multiprocessing passes them):
    the file was written by the worker this process spawned, into a directory ``tempfile`` made for this run only
    (mode 0700), never a path anyone else names."""
    path = Path(tmp) / f"rank{rank}.pkl"
    if not path.exists():
        return None
    with open(path, "rb") as f:
        return pickle.load(f)
