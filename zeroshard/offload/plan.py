"""The offload settings of one run, resolved from ``zero_optimization.offload_*`` and ``aio``, and the
factories that put a rank's state where they say (host memory or swap files under ``nvme_path``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .aio import AioSettings, SwapFile
from .optimizer_swap import NvmeOptimizerSwapper
from .param_store import BufferPool, HostShard, NvmeShard


@dataclass
class OffloadPlan:
    optimizer_device: str = "none"  # none | cpu | nvme: fp32 master weights, gradient shards, optimizer state
    param_device: str = "none"  # none | cpu | nvme: stage-3 parameter shards between gathers
    pin_memory: bool = False
    sub_group_size: int = 1_000_000_000
    optimizer_buffer_count: int = 4
    optimizer_nvme_path: Optional[str] = None
    param_nvme_path: Optional[str] = None
    param_buffer_count: int = 5
    param_buffer_size: int = 100_000_000
    max_in_cpu: int = 1_000_000_000
    aio: AioSettings = AioSettings()
    rank: int = 0
    param_pool: Optional[BufferPool] = None  # host staging buffers of NVMe-offloaded parameter shards

    @classmethod
    def from_config(cls, zero_cfg, aio_cfg, rank: int, can_pin: bool) -> "OffloadPlan":
        opt, par = zero_cfg.offload_optimizer, zero_cfg.offload_param
        plan = cls(sub_group_size=zero_cfg.sub_group_size, aio=AioSettings.from_config(aio_cfg), rank=rank)
        if opt is not None and opt.device.value != "none":
            plan.optimizer_device = opt.device.value
            plan.optimizer_nvme_path = str(opt.nvme_path) if opt.nvme_path is not None else None
            plan.optimizer_buffer_count = opt.buffer_count
            plan.pin_memory |= opt.pin_memory and can_pin
        if par is not None and par.device.value != "none":
            plan.param_device = par.device.value
            plan.param_nvme_path = str(par.nvme_path) if par.nvme_path is not None else None
            plan.param_buffer_count, plan.param_buffer_size, plan.max_in_cpu = (
                par.buffer_count,
                par.buffer_size,
                par.max_in_cpu,
            )
            plan.pin_memory |= par.pin_memory and can_pin
        return plan

    @property
    def offloads_optimizer(self) -> bool:
        return self.optimizer_device != "none"

    def _swap_file(self, directory: str, kind: str) -> SwapFile:
        return SwapFile(directory, f"zeroshard-{kind}-rank{self.rank}-pid{os.getpid()}.swap", self.aio)

    def optimizer_swapper(self, max_numel: int, synchronize: Callable[[], None]) -> NvmeOptimizerSwapper:
        """The swapper of NVMe-offloaded optimizer state, staging sub-groups of up to ``max_numel`` elements."""
        file = self._swap_file(self.optimizer_nvme_path, "optimizer")
        return NvmeOptimizerSwapper(file, self.optimizer_buffer_count, max_numel, self.pin_memory, synchronize)

    def shard_homes(self, compute_dtype: torch.dtype, largest_shard: int) -> Optional[Callable[[torch.Tensor], object]]:
        """A factory placing each stage-3 shard: host memory (``cpu``, or ``nvme`` within ``max_in_cpu``
        elements), else the parameter swap file, staged through ``buffer_count`` buffers of
        ``min(buffer_size, largest_shard)`` elements."""
        if self.param_device == "none":
            return None
        state = {"in_cpu": 0, "file": None}
        element = torch.empty((), dtype=compute_dtype).element_size()
        buffer_numel = min(self.param_buffer_size, largest_shard)

        def place(shard: torch.Tensor):
            if self.param_device == "cpu" or state["in_cpu"] + shard.numel() <= self.max_in_cpu:
                state["in_cpu"] += shard.numel() if self.param_device == "nvme" else 0
                return HostShard(shard, self.pin_memory)
            if shard.numel() > self.param_buffer_size:
                raise ValueError(
                    f"zero_optimization.offload_param.buffer_size={self.param_buffer_size} elements is smaller than "
                    f"a gather unit's shard ({shard.numel()} elements); raise buffer_size to at least that"
                )
            if state["file"] is None:
                state["file"] = self._swap_file(self.param_nvme_path, "param")
                self.param_pool = BufferPool(self.param_buffer_count, buffer_numel * element, self.pin_memory)
            return NvmeShard(shard, state["file"], self.param_pool)

        return place
