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
    inject_delays,
    reduce_scatter,
)
from .groups import Group, RankGrid, build_rank_grid, build_tensor_parallel_group, destroy_groups, grid_layout
from .ledger import LEDGER, CommLedger, OpTotals


def log_summary(print_fn=print) -> str:
    """Print (and return) bytes and calls per (op, group) counted since start or the last reset."""
    text = LEDGER.format()
    print_fn(text)
    return text


__all__ = [
    "DEFAULT_TIMEOUT",
    "LEDGER",
    "CollectiveError",
    "CommLedger",
    "Group",
    "OpTotals",
    "Pending",
    "RankGrid",
    "all_gather",
    "all_reduce",
    "barrier",
    "broadcast",
    "build_rank_grid",
    "build_tensor_parallel_group",
    "destroy",
    "destroy_at_exit",
    "destroy_groups",
    "env_world",
    "get_rank",
    "get_world_size",
    "grid_layout",
    "init_distributed",
    "inject_delays",
    "is_initialized",
    "log_summary",
    "reduce_scatter",
]
