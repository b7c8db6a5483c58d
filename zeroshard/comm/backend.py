"""Process-group setup from the environment that torchrun, mpirun or SLURM leaves behind."""

from __future__ import annotations

import atexit
import os
import socket
import sys
import time
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from ..accelerator import get_accelerator
from .context import DEFAULT_CONTEXT
from .trace import announce_exit

DEFAULT_TIMEOUT = timedelta(minutes=5)

# (rank, world size, local rank) variable names, most specific launcher first.
_ENV_SCHEMES = (
    ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _slurm_master_addr() -> Optional[str]:
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodelist:
        return None
    # "node[01-04],other" -> "node01": the first host of the first range
    head = nodelist.split(",")[0]
    if "[" in head:
        prefix, rest = head.split("[", 1)
        head = prefix + rest.split("-")[0].split(",")[0].rstrip("]")
    return head


def env_world() -> tuple[int, int, int]:
    """(rank, world size, local rank) from the launcher's environment; (0, 1, 0) when there is none."""
    for rank_var, size_var, local_var in _ENV_SCHEMES:
        if rank_var in os.environ and size_var in os.environ:
            rank, size = int(os.environ[rank_var]), int(os.environ[size_var])
            local = int(os.environ.get(local_var, os.environ.get("LOCAL_RANK", 0)))
            return rank, size, local
    return 0, 1, 0


def init_distributed(
    dist_backend: Optional[str] = None,
    timeout: timedelta = DEFAULT_TIMEOUT,
    init_method: Optional[str] = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Join the default process group (no-op when already joined).

    A plain ``python train.py`` with no launcher becomes a one-process group on a free local port.
    """
    if dist.is_initialized():
        return
    env_rank, env_size, local_rank = env_world()
    rank = env_rank if rank < 0 else rank
    world_size = env_size if world_size < 0 else world_size
    accel = get_accelerator()
    backend = dist_backend or accel.comm_backend
    _check_backend(backend, rank)
    if init_method is None:
        os.environ.setdefault("MASTER_ADDR", _slurm_master_addr() or "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            if world_size > 1:
                raise ValueError(
                    f"rank {rank} of {world_size}: MASTER_PORT is not set; launch with `zeroshard` or torchrun, "
                    "or export MASTER_ADDR and MASTER_PORT"
                )
            os.environ["MASTER_PORT"] = str(_free_port())
        init_method = "env://"
    os.environ.setdefault("LOCAL_RANK", str(local_rank))
    accel.set_device(local_rank)
    _import_before_joining()
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)
    destroy_at_exit()


_KNOWN_BACKENDS = ("nccl", "gloo", "mpi", "ucc", "xccl")


def _check_backend(backend: str, rank: int) -> None:
    """A backend this torch build lacks (NCCL on a CPU-only install, NCCL without a GPU) is named up front, with the
    ones that are there, instead of failing inside ``init_process_group``. ``backend`` may be torch's per-device form
    (``cpu:gloo,cuda:nccl``)."""
    names = [part.rpartition(":")[2].strip() for part in str(backend).lower().split(",")]
    gpu = get_accelerator().name != "cpu"

    def usable(name: str) -> bool:
        return dist.is_backend_available(name) and (name != "nccl" or gpu)

    missing = [n for n in names if not usable(n)]
    if missing:
        available = [n for n in _KNOWN_BACKENDS if usable(n)]
        why = " (NCCL needs a CUDA GPU)" if "nccl" in missing and dist.is_backend_available("nccl") else ""
        raise ValueError(
            f"rank {rank}: dist_backend {backend!r} is not available on this machine{why}; available: "
            f"{', '.join(available) or 'none'} (leave dist_backend unset to use {get_accelerator().comm_backend!r})"
        )


def _import_before_joining() -> None:
    """Note [a process group that outlives destroy]: some torch modules (``torch.distributed.nn`` and others that
    ``torch._dynamo`` pulls in, which the first optimizer construction imports) take ``group=group.WORLD`` as a
    default argument. Imported after the process group exists, they hold it forever: ``destroy_process_group``
    then cannot free it, its Gloo worker threads outlive the interpreter, and a worker that drops a finished
    collective's tensors during interpreter shutdown aborts the process (SIGABRT after a clean run). Imported
    first, their defaults hold ``None``."""
    import torch._dynamo  # noqa: F401
    import torch.distributed.nn  # noqa: F401


_destroy_registered = False  # the interpreter's exit is process-wide, so is this one flag


def destroy_at_exit() -> None:
    """Make sure the process group is torn down when the script ends, whether or not the user does it.

    A process that exits with Gloo's (or NCCL's) threads still running aborts in C++ static destruction
    ("terminate called without an active exception", SIGABRT), and a scheduler then marks a finished job as
    failed. ``atexit`` runs after the script's last line, also when the user never calls anything."""
    global _destroy_registered
    if not _destroy_registered:
        _destroy_registered = True
        atexit.register(_destroy_at_exit)


def _destroy_at_exit() -> None:
    # an uncaught exception leaves sys.last_value behind: that rank did not end normally
    destroy(announce=not hasattr(sys, "last_value"))


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


EXIT_WAIT_S = 30.0  # how long the rank hosting the store waits at exit for the others to be done with it
_EXITED = "zeroshard/exited"


def destroy(announce: bool = True) -> None:
    """Leave the process group (every group): a local call, ranks may do it at different moments. With
    ``announce``, first tell the other ranks through the store that this rank's script ended normally, so a rank
    still waiting in a collective names it as such.

    Note [ordered exit]: under a launcher whose agent does not host the store, rank 0's process does (torch's
    ``env://``): once it exits, a rank still writing to the store (its own exit note) gets a broken pipe, which
    torch prints as a C++ trace although the run succeeded. So each rank says when it is done with the store, and
    rank 0, ending normally, keeps the store up until the others have (at most ``EXIT_WAIT_S``: a rank that died
    never says)."""
    if not is_initialized():
        return
    store, rank, world = default_store(), get_rank(), get_world_size()
    if announce and store is not None:
        announce_exit(store, rank, DEFAULT_CONTEXT.trace)
    dist.destroy_process_group()  # the store outlives it: ``store`` holds it
    if store is None or world == 1 or not _rank0_hosts(store):
        return
    try:
        if rank != 0:
            store.add(_EXITED, 1)
        elif announce:
            deadline = time.monotonic() + EXIT_WAIT_S
            while store.add(_EXITED, 0) < world - 1 and time.monotonic() < deadline:
                time.sleep(0.02)
    except Exception:  # noqa: BLE001 - leaving anyway: the store (or its host) may be gone after a failure
        pass


def _rank0_hosts(store) -> bool:
    """Whether rank 0's process serves the store (a TCP store the launcher's agent does not host)."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return isinstance(store, dist.TCPStore) and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true"


def default_store():
    """The default process group's key-value store (for out-of-band exchanges such as hang forensics)."""
    if not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError):
        return None


def available_backends() -> dict[str, bool]:
    """Which torch.distributed backends this build of torch offers (for the environment report)."""
    return {
        "nccl": dist.is_nccl_available(),
        "gloo": dist.is_gloo_available(),
        "mpi": dist.is_mpi_available(),
    }
