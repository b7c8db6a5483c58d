"""Device abstraction: the same code path runs on CUDA (NCCL) and on CPU (Gloo)."""

from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class Accelerator:
    name: str  # "cuda" or "cpu"
    comm_backend: str  # "nccl" or "gloo"

    def device(self, local_rank: int = 0) -> torch.device:
        if self.name == "cpu":
            return torch.device("cpu")
        return torch.device(self.name, local_rank)

    def set_device(self, local_rank: int) -> None:
        if self.name == "cuda":
            torch.cuda.set_device(local_rank)

    def supported_dtypes(self) -> list[torch.dtype]:
        """DeepSpeed's list form of :meth:`supports_dtype` (its tests pick their cases by it)."""
        return [d for d in (torch.float32, torch.bfloat16, torch.float16) if self.supports_dtype(d)]

    def supports_dtype(self, dtype: torch.dtype) -> bool:
        if self.name == "cuda" and dtype is torch.bfloat16:
            return torch.cuda.is_bf16_supported()
        return True

    @property
    def can_pin_memory(self) -> bool:
        """Page-locked host memory only helps (and only exists) with a device to copy to."""
        return self.name == "cuda"

    def synchronize(self) -> None:
        """Wait for queued device work (e.g. non-blocking copies out of a host buffer about to be reused)."""
        if self.name == "cuda":
            torch.cuda.synchronize()

    def max_memory_allocated(self) -> int:
        """Peak device bytes; on CPU the process's peak resident set."""
        if self.name == "cuda":
            return torch.cuda.max_memory_allocated()
        return host_peak_rss()

    # -- DeepSpeed's accelerator interface (clients such as HF call these by name) --------------------------
    def device_name(self, device_index: Optional[int] = None) -> str:
        """``"cuda"`` / ``"cuda:1"``, or ``"cpu"`` (a CPU has no index)."""
        if device_index is None or self.name == "cpu":
            return self.name
        return f"{self.name}:{device_index}"

    def current_device(self) -> int:
        return torch.cuda.current_device() if self.name == "cuda" else 0

    def current_device_name(self) -> str:
        return self.device_name(self.current_device()) if self.name == "cuda" else "cpu"

    def device_count(self) -> int:
        """GPUs; on CPU, as DeepSpeed's CPU accelerator counts: ``LOCAL_SIZE`` (the node's ranks) when set, else 1."""
        if self.name == "cuda":
            return torch.cuda.device_count()
        local_size = os.environ.get("LOCAL_SIZE", "")
        return int(local_size) if local_size.isdigit() and int(local_size) > 0 else 1

    def is_available(self) -> bool:
        """The device can run work now (the CPU always can)."""
        return torch.cuda.is_available() if self.name == "cuda" else True

    def memory_allocated(self) -> int:
        """Device bytes in use now; on CPU the process's resident set."""
        if self.name == "cuda":
            return torch.cuda.memory_allocated()
        return host_rss()

    def is_bf16_supported(self) -> bool:
        return self.supports_dtype(torch.bfloat16)

    def is_fp16_supported(self) -> bool:
        return True

    def communication_backend_name(self) -> str:
        return self.comm_backend

    def empty_cache(self) -> None:
        if self.name == "cuda":
            torch.cuda.empty_cache()

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)  # also seeds every CUDA device


def proc_field_kib(path: str, field: str) -> Optional[int]:
    """A ``Field:  N kB`` line of a /proc file (``/proc/self/status``, ``/proc/meminfo``), in KiB; None without it."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def host_rss() -> int:
    """This process's resident set now, in bytes (0 where /proc is unavailable)."""
    return (proc_field_kib("/proc/self/status", "VmRSS") or 0) * 1024


def host_peak_rss() -> int:
    """This process's peak resident set in bytes. Linux's VmHWM, not ``ru_maxrss``: a spawned process
    inherits its parent's ``ru_maxrss`` across fork and exec, so a worker started by a big parent would
    report the parent's peak."""
    peak = proc_field_kib("/proc/self/status", "VmHWM")
    if peak is not None:
        return peak * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def release_host_memory() -> None:
    """Hand freed heap memory back to the operating system (glibc's ``malloc_trim``; nothing elsewhere). After a
    large host tensor is freed, glibc raises its mmap threshold and serves the next ones from the heap, where a small
    live allocation above them keeps the whole span resident: code that allocates and frees one large tensor after
    another (zero.Init putting parameters away) would otherwise grow the resident set toward the sum of them."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim if sys.platform.startswith("linux") else False
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim = None

# host blocks from this size are mapped apart from the heap and unmapped when freed: 4 MiB keeps the resident set
# as flat as 1 MiB does (0.82 against 0.74 bytes per parameter over 2 ranks, 59M -> 210M GPT under NVMe offload)
# and maps a quarter as many blocks afresh (each costs page faults: 1 MiB made that step ~10% slower)
HEAP_MMAP_THRESHOLD = 4 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers (malloc.h)


def bound_host_heap() -> bool:
    """Make glibc map every host block of ``HEAP_MMAP_THRESHOLD`` bytes or more on its own and unmap it when freed,
    as ``MALLOC_MMAP_THRESHOLD_=4194304`` would; True when it took effect. NVMe offload calls it: there the model
    lives on disk, and what remains in RAM is transient -- gathered units, gradients, activations -- whose freed
    blocks glibc would otherwise keep in its heap (its threshold rises to each freed block's size, up to 32 MiB),
    so that the resident set grew with the model (10.4 bytes per parameter over 2 ranks between a 59M and a 210M
    GPT, against 0.7 with this; ``docs/benchmarks.md``). A threshold the user set in the environment is kept;
    nothing happens off glibc."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    # the trim threshold too: glibc doubled it with each raise of the mmap threshold before this call
    return bool(mallopt(_M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, 2 * HEAP_MMAP_THRESHOLD))


def get_accelerator() -> Accelerator:
    """CUDA when a GPU is visible, unless ZEROSHARD_ACCELERATOR=cpu forces the CPU path."""
    forced = os.environ.get("ZEROSHARD_ACCELERATOR", "").lower()
    if forced not in ("", "cpu", "cuda"):
        raise ValueError(f"ZEROSHARD_ACCELERATOR={forced!r}: expected 'cpu' or 'cuda'")
    if forced == "cuda" or (forced == "" and torch.cuda.is_available()):
        return Accelerator("cuda", "nccl")
    return Accelerator("cpu", "gloo")
