"""Device abstraction: the same code path runs on CUDA (NCCL) and on CPU (Gloo)."""

from __future__ import annotations

import os
from dataclasses import dataclass

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


def host_peak_rss() -> int:
    """This process's peak resident set in bytes. Linux's VmHWM, not ``ru_maxrss``: a spawned process
    inherits its parent's ``ru_maxrss`` across fork and exec, so a worker started by a big parent would
    report the parent's peak."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def get_accelerator() -> Accelerator:
    """CUDA when a GPU is visible, unless ZEROSHARD_ACCELERATOR=cpu forces the CPU path."""
    forced = os.environ.get("ZEROSHARD_ACCELERATOR", "").lower()
    if forced not in ("", "cpu", "cuda"):
        raise ValueError(f"ZEROSHARD_ACCELERATOR={forced!r}: expected 'cpu' or 'cuda'")
    if forced == "cuda" or (forced == "" and torch.cuda.is_available()):
        return Accelerator("cuda", "nccl")
    return Accelerator("cpu", "gloo")
