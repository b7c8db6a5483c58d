"""Offload (ZeRO-Offload / ZeRO-Infinity): optimizer state and stage-3 parameter shards in host memory
or in swap files on NVMe, moved with asynchronous positioned I/O from Python threads."""

from .aio import OffloadIOError, SwapFile
from .optimizer_swap import NvmeOptimizerSwapper, SubGroup
from .plan import OffloadPlan

__all__ = ["NvmeOptimizerSwapper", "OffloadIOError", "OffloadPlan", "SubGroup", "SwapFile"]
