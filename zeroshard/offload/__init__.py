"""Offload (ZeRO-Offload / ZeRO-Infinity): optimizer state and stage-3 parameter shards in host memory
or in swap files on NVMe, moved with asynchronous positioned I/O from Python threads."""

from .aio import IOStats, OffloadIOError, SwapChecksumError, SwapFile, hidden_waits
from .optimizer_swap import MASTER, NvmeOptimizerSwapper, SubGroup, elementwise_keys
from .param_store import NvmeShard
from .plan import (
    OffloadDevice,
    OffloadPlan,
    ShardHome,
    ShardHomes,
    choose_kept,
    kept_on_device,
    kept_within,
    optimizer_swapper,
    shard_homes,
)

__all__ = [
    "IOStats",
    "MASTER",
    "NvmeOptimizerSwapper",
    "NvmeShard",
    "OffloadIOError",
    "SwapChecksumError",
    "OffloadDevice",
    "OffloadPlan",
    "ShardHome",
    "ShardHomes",
    "SubGroup",
    "SwapFile",
    "elementwise_keys",
    "choose_kept",
    "hidden_waits",
    "kept_on_device",
    "kept_within",
    "optimizer_swapper",
    "shard_homes",
]
