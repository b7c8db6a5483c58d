"""The communication layer: the only package that imports ``torch.distributed``."""

from .backend import (
    DEFAULT_TIMEOUT,
    destroy,
    destroy_at_exit,
    env_world,
    get_rank,
    get_world_size,
    init_distributed,
    is_initialized,
)
from .collectives import (
    CollectiveError,
    Pending,
    all_gather,
    all_reduce,
    barrier,
    broadcast,
    post_send,
    recv,
    reduce_scatter,
    reduce_scatter_scratch_numel,
    send,
)
from .compressed import OneBitAllReduce, compressed_all_gather, compressed_all_reduce, compressed_reduce_scatter
from .context import DEFAULT_CONTEXT, CommContext
from .groups import Group, as_group, group_of, group_timeout, process_group, solo_group, world_group
from .ledger import CommLedger, OpTotals
from .mesh import (
    DERIVED,
    Mesh,
    ParallelDims,
    build_groups,
    build_mesh,
    destroy_mesh,
    planned_group,
    tensor_parallel_group,
)

LEDGER = DEFAULT_CONTEXT.ledger  # every collective of this process (an engine's own: engine.comm_ledger)


def log_summary(print_fn=print) -> str:
    """Print (and return) bytes and calls per (op, group) this process issued, counted since start or the last
    reset of the default context's ledger."""
    text = LEDGER.format()
    print_fn(text)
    return text


__all__ = [
    "DEFAULT_CONTEXT",
    "DERIVED",
    "DEFAULT_TIMEOUT",
    "LEDGER",
    "CollectiveError",
    "CommContext",
    "CommLedger",
    "Group",
    "OneBitAllReduce",
    "OpTotals",
    "ParallelDims",
    "Pending",
    "Mesh",
    "all_gather",
    "all_reduce",
    "barrier",
    "broadcast",
    "build_groups",
    "build_mesh",
    "compressed_all_gather",
    "compressed_all_reduce",
    "compressed_reduce_scatter",
    "destroy",
    "destroy_at_exit",
    "destroy_mesh",
    "env_world",
    "get_rank",
    "get_world_size",
    "as_group",
    "group_of",
    "group_timeout",
    "init_distributed",
    "is_initialized",
    "log_summary",
    "planned_group",
    "post_send",
    "process_group",
    "recv",
    "send",
    "solo_group",
    "world_group",
    "reduce_scatter",
    "reduce_scatter_scratch_numel",
    "tensor_parallel_group",
]
