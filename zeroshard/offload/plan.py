"""The offload settings of one run (data only), resolved from ``zero_optimization.offload_*`` and ``aio``, and the
objects that put a rank's state where they say: :class:`ShardHomes` places stage-3 parameter shards (and owns the
staging pool their NVMe homes share); :func:`optimizer_swapper` makes the NVMe optimizer-state swapper."""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Optional, Protocol, Union

import torch

from ..partition import round_up
from .aio import AioSettings, SwapFile
from .optimizer_swap import NvmeOptimizerSwapper
from .param_store import BufferPool, HostShard, NvmeShard


class OffloadDevice(str, Enum):
    """Where offloaded state lives (compares equal to DeepSpeed's strings: ``"none"``, ``"cpu"``, ``"nvme"``)."""

    NONE = "none"
    CPU = "cpu"
    NVME = "nvme"


class ShardHome(Protocol):
    """Where one stage-3 shard lives between gathers (``HostShard``, ``NvmeShard``, ZeRO++'s ``QuantizedShard``)."""

    on_host: bool  # its values cross the host link on their way to and from the compute device

    def fetch(self) -> None: ...  # start reading it (a hint; NVMe reads ahead)

    def get(self) -> torch.Tensor: ...  # the shard, valid until release

    def release(self) -> None: ...

    def write(self, start: int, values: torch.Tensor) -> None: ...  # part of the updated shard

    def flush(self) -> None: ...  # the updated shard is complete: write it home

    def bytes(self) -> dict[str, int]: ...  # bytes held, by location


# sub-groups start at multiples of this many elements: the CPU optimizer's vectorized kernels then see every element
# in the lane it has when the whole shard is stepped at once, so an offloaded step is bit-identical to an in-memory
# one (a boundary at 700 elements moved AdamW's result in the last bit; 696 and 704 did not)
SUB_GROUP_ALIGN = 64


@dataclass(frozen=True)
class OffloadPlan:
    optimizer_device: OffloadDevice = OffloadDevice.NONE  # fp32 master weights, gradient shards, optimizer state
    param_device: OffloadDevice = OffloadDevice.NONE  # stage-3 parameter shards between gathers
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
    speculate: Optional[bool] = None  # offload_optimizer.super_offload: step during backward (None: where it helps)
    speculation_cores: float = 0.8  # offload_optimizer.cpuadam_cores_perc
    speculation_host_bytes: Optional[int] = None  # host memory for its shadows (None: no bound)
    ratio: Union[float, str] = 1.0  # offload_optimizer.ratio: the share offloaded (or "auto")
    keep_on_device_bytes: Optional[int] = None  # ratio "auto": the device memory the kept state may use

    @classmethod
    def from_config(cls, zero_cfg, aio_cfg, rank: int, can_pin: bool) -> "OffloadPlan":
        opt, par = zero_cfg.offload_optimizer, zero_cfg.offload_param
        fields: dict = {
            "sub_group_size": round_up(zero_cfg.sub_group_size, SUB_GROUP_ALIGN),
            "aio": AioSettings.from_config(aio_cfg),
            "rank": rank,
        }
        pin = False
        if opt is not None and opt.device.value != "none":
            fields.update(
                optimizer_device=OffloadDevice(opt.device.value),
                optimizer_nvme_path=str(opt.nvme_path) if opt.nvme_path is not None else None,
                optimizer_buffer_count=opt.buffer_count,
                speculate=opt.super_offload,
                speculation_cores=opt.cpuadam_cores_perc,
                speculation_host_bytes=opt.speculation_host_bytes,
                ratio=opt.ratio,
                keep_on_device_bytes=opt.keep_on_device_bytes,
            )
            pin |= opt.pin_memory and can_pin
        if par is not None and par.device.value != "none":
            fields.update(
                param_device=OffloadDevice(par.device.value),
                param_nvme_path=str(par.nvme_path) if par.nvme_path is not None else None,
                param_buffer_count=par.buffer_count,
                param_buffer_size=par.buffer_size,
                max_in_cpu=par.max_in_cpu,
            )
            pin |= par.pin_memory and can_pin
        return cls(pin_memory=pin, **fields)

    @property
    def offloads_optimizer(self) -> bool:
        return self.optimizer_device is not OffloadDevice.NONE

    @property
    def on_nvme(self) -> bool:
        """Whether any state lives in swap files (then host memory holds only transient and bounded buffers)."""
        return OffloadDevice.NVME in (self.optimizer_device, self.param_device)

    def swap_file(self, directory: str, kind: str) -> SwapFile:
        return SwapFile(directory, f"zeroshard-{kind}-rank{self.rank}-pid{os.getpid()}.swap", self.aio)


def kept_on_device(numels: list[int], ratio: float) -> frozenset[int]:
    """Under ``offload_optimizer.ratio`` (the share offloaded), the flat groups (by their shard's ``numels``, in
    reduction order) whose optimizer state stays on the compute device: those reduced last in backward, as many as fit
    ``1 - ratio`` of the elements. Their gradients come last, where a step during backward would have the least time
    to run; kept, they step on the device right after the verdict while the offloaded ones, stepped during backward,
    only commit. A share between two flat groups rounds down (the kept part never exceeds it)."""
    return kept_within(numels, [float(n) for n in numels], (1.0 - ratio) * sum(numels))


# ratio "auto" counts Adam's bytes per element kept on the device: the fp32 master, the gradient, two moments
AUTO_BYTES_PER_ELEMENT = 16


def choose_kept(numels: list[int], ratio: Union[float, str], budget: int) -> frozenset[int]:
    """``offload_optimizer.ratio``: a share (:func:`kept_on_device`), or ``"auto"``: as many flat groups as fit
    ``budget`` bytes of device memory at :data:`AUTO_BYTES_PER_ELEMENT` (decided before the optimizer exists: an
    optimizer with fewer state tensors keeps less than it could); none fitting is an error naming the budget."""
    per_element = AUTO_BYTES_PER_ELEMENT
    if ratio != "auto":
        return kept_on_device(numels, float(ratio))
    kept = kept_within(numels, [float(n * per_element) for n in numels], budget)
    if numels and not kept:
        raise ValueError(
            f"offload_optimizer.ratio 'auto': a budget of {budget} bytes of device memory keeps none of the optimizer "
            f"state there (the flat group reduced last needs {numels[-1] * per_element} bytes); set ratio to 1 to "
            "offload all of it, or raise offload_optimizer.keep_on_device_bytes"
        )
    return kept


def kept_within(numels: list[int], cost: list[float], budget: float) -> frozenset[int]:
    """The flat groups reduced last whose ``cost`` together fits ``budget`` (stopping at the first that does not)."""
    kept, total = set(), 0.0
    for index in reversed(range(len(numels))):
        if total + cost[index] > budget:
            break
        kept.add(index)
        total += cost[index]
    return frozenset(kept)


def optimizer_swapper(plan: OffloadPlan, max_numel: int, synchronize: Callable[[], None]) -> NvmeOptimizerSwapper:
    """The swapper of NVMe-offloaded optimizer state, staging sub-groups of up to ``max_numel`` elements."""
    file = plan.swap_file(plan.optimizer_nvme_path, "optimizer")
    return NvmeOptimizerSwapper(file, plan.optimizer_buffer_count, max_numel, plan.pin_memory, synchronize)


class ShardHomes:
    """Places each stage-3 shard: host memory (``cpu``, or ``nvme`` within ``max_in_cpu`` elements), else the
    parameter swap file, staged through ``buffer_count`` host buffers of ``min(buffer_size, largest_shard)`` elements
    that every NVMe home shares (this object owns them, created with the first NVMe home)."""

    def __init__(self, plan: OffloadPlan, compute_dtype: torch.dtype, largest_shard: int):
        self.plan = plan
        self.in_cpu = 0  # elements of NVMe-offloaded parameters kept in host memory (max_in_cpu)
        self.file: Optional[SwapFile] = None
        self.pool: Optional[BufferPool] = None
        self._buffer_bytes = (
            min(plan.param_buffer_size, largest_shard) * torch.empty((), dtype=compute_dtype).element_size()
        )

    def place(self, shard: torch.Tensor) -> ShardHome:
        plan = self.plan
        if plan.param_device is OffloadDevice.CPU or self.in_cpu + shard.numel() <= plan.max_in_cpu:
            self.in_cpu += shard.numel() if plan.param_device is OffloadDevice.NVME else 0
            return HostShard(shard, plan.pin_memory)
        if shard.numel() > plan.param_buffer_size:
            raise ValueError(
                f"zero_optimization.offload_param.buffer_size={plan.param_buffer_size} elements is smaller than "
                f"a gather unit's shard ({shard.numel()} elements); raise buffer_size to at least that"
            )
        if self.file is None:
            self.file = plan.swap_file(plan.param_nvme_path, "param")
            self.pool = BufferPool(plan.param_buffer_count, self._buffer_bytes, plan.pin_memory)
        return NvmeShard(shard, self.file, self.pool)

    def swap_files(self) -> list[SwapFile]:
        return [self.file] if self.file is not None else []

    def bytes_held(self) -> dict[str, dict[str, int]]:
        """The shared staging buffers (each home counts its own shard)."""
        return {"params": {"host": self.pool.bytes_in_memory if self.pool is not None else 0}}


def shard_homes(plan: OffloadPlan, compute_dtype: torch.dtype, largest_shard: int) -> Optional[ShardHomes]:
    """The homes of stage-3 shards under ``offload_param``, or None when shards stay on the device."""
    if plan.param_device is OffloadDevice.NONE:
        return None
    return ShardHomes(plan, compute_dtype, largest_shard)
