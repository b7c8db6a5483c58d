"""``deepspeed.comm``: :mod:`zeroshard.comm.torch_style` (torch.distributed's signatures over zeroshard's counted,
traced collectives) plus DeepSpeed's ``init_distributed``."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Optional

from zeroshard import comm as _comm
from zeroshard.comm.torch_style import *  # noqa: F403
from zeroshard.comm.torch_style import __all__ as _torch_style

TORCH_DISTRIBUTED_DEFAULT_PORT = 29500


def init_distributed(
    dist_backend: Optional[str] = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT,
    verbose: bool = True,
    timeout: timedelta = _comm.DEFAULT_TIMEOUT,
    init_method: Optional[str] = None,
    dist_init_required: Optional[bool] = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """DeepSpeed's signature. ``auto_mpi_discovery``/``verbose``/``config`` change nothing here: the rank comes
    from the launcher's environment (torchrun, SLURM, OpenMPI variables), and ``distributed_port`` is used when
    the environment names no port for a multi-process job."""
    if dist_init_required is False:
        if not _comm.is_initialized():
            raise RuntimeError(
                "init_distributed(dist_init_required=False): no process group exists; pass dist_init_required=True "
                "(or leave it unset) to create one, or create it before this call"
            )
        return
    if rank >= 0 or "RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ:
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
    _comm.init_distributed(dist_backend, timeout=timeout, init_method=init_method, rank=rank, world_size=world_size)


def mpi_discovery(distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT, verbose: bool = True) -> None:
    """DeepSpeed's discovery of the rank, world size and master address through mpi4py: refused by name."""
    raise NotImplementedError(
        "deepspeed.comm.mpi_discovery (the rank, world size and master address from mpi4py) is not implemented by "
        "zeroshard: init_distributed() reads an MPI launcher's OMPI_COMM_WORLD_* / PMI_* variables itself; export "
        "MASTER_ADDR (rank 0's host) and MASTER_PORT, or launch with `zeroshard --launcher openmpi`"
    )


__all__ = ["TORCH_DISTRIBUTED_DEFAULT_PORT", "init_distributed", "mpi_discovery", *_torch_style]
