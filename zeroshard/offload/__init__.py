"""Offload (ZeRO-Offload / ZeRO-Infinity): optimizer state and stage-3 parameter shards in host memory
or in swap files on NVMe, moved with asynchronous positioned I/O from Python threads."""

from .aio import OffloadIOError, SwapFile
from .optimizer_swap import MASTER, NvmeOptimizerSwapper, SubGroup, elementwise_keys
from .plan import OffloadPlan

__all__ = [
    "MASTER",
    "NvmeOptimizerSwapper",
    "OffloadIOError",
    "OffloadPlan",
    "SubGroup",
    "SwapFile",
    "elementwise_keys",
]
