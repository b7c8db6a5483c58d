"""What ``zeroshard.estimate`` returns: one rank's predicted bytes by category and location."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


def cpu_only() -> bool:
    from ..accelerator import get_accelerator

    return get_accelerator().name == "cpu"


CATEGORIES = (
    "runtime",
    "parameters",
    "gradients",
    "optimizer_state",
    "gathered_units",
    "communication_buffers",
    "activations",
    "allocator",
)


LOCATIONS = ("device", "host", "nvme")


@dataclass
class MemoryEstimate:
    """One rank's predicted memory: ``bytes[category][location]``; ``peak`` sums the device (or, on a CPU-only
    machine, the whole process) side."""

    world_size: int
    stage: int
    micro_batch: int
    params: int
    bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    disk_per_step: dict[str, int] = field(default_factory=lambda: {"read": 0, "written": 0})  # NVMe offload
    disk_bandwidth: Optional[dict[str, float]] = None  # bytes/s the nvme_path gave a probe, when measured

    def total(self, location: str) -> int:
        return sum(self.bytes[c][location] for c in CATEGORIES)

    @property
    def peak(self) -> int:
        """The predicted peak of the quantity a run is judged by: process RSS on CPU (device + host are one
        memory), device memory on GPU."""
        return self.total("device") + (self.total("host") if cpu_only() else 0)

    def table(self) -> str:
        lines = [
            f"zeroshard estimate: {self.params / 1e6:.1f}M parameters, ZeRO stage {self.stage}, "
            f"{self.world_size} rank(s), micro-batch {self.micro_batch}; per rank, MiB",
            f"{'category':<24}" + "".join(f"{where:>12}" for where in LOCATIONS),
        ]
        for category in CATEGORIES:
            row = self.bytes[category]
            lines.append(f"{category:<24}" + "".join(f"{row[w] / 2**20:>12.1f}" for w in LOCATIONS))
        lines.append(f"{'total':<24}" + "".join(f"{self.total(w) / 2**20:>12.1f}" for w in LOCATIONS))
        what = "process RSS (CPU run)" if cpu_only() else "device memory"
        lines.append(f"predicted peak {what}: {self.peak / 2**20:.1f} MiB")
        read, written = self.disk_per_step["read"], self.disk_per_step["written"]
        if read or written:
            line = f"disk per optimizer step: {read / 1e9:.3f} GB read + {written / 1e9:.3f} GB written"
            if self.disk_bandwidth:
                seconds = read / self.disk_bandwidth["read"] + written / self.disk_bandwidth["write"]
                line += (
                    f"; the nvme_path measured {self.disk_bandwidth['read'] / 1e9:.2f} GB/s read, "
                    f"{self.disk_bandwidth['write'] / 1e9:.2f} GB/s write: {seconds:.2f} s of disk time per step"
                )
            lines.append(line)
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)
