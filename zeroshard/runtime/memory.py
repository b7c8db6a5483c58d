"""Where the memory goes: model-state bytes by category at start and at the largest sample, per rank.

Sampled (cheaply, from the tensors the engine holds) after forward, after backward's reductions were
issued, and after the optimizer step; printed once, after the first optimizer step, as a table with
one row per rank; ``engine.memory_breakdown()`` returns the same as a dict.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import comm

CATEGORIES = ("parameters", "gradients", "optimizer_state", "communication_buffers", "gathered_units", "idle_buffers")


def categorize(by_location: dict[str, dict[str, int]]) -> dict[str, int]:
    """Engine roles -> the user-facing categories (all locations summed), plus per-location totals."""
    role = {k: sum(places[k] for places in by_location.values()) for k in by_location["device"]}
    out = {
        "parameters": role["params"],
        "gradients": role["grad_shard"],
        "optimizer_state": role["master"] + role["optimizer_state"],
        "communication_buffers": role["staging"],
        "gathered_units": role["gathered"],
        "idle_buffers": role["idle_buffers"],  # owned gather/staging buffers kept for reuse
    }
    for where, places in by_location.items():
        out[f"on_{where}"] = sum(places.values())
    return out


class MemoryTracker:
    def __init__(self):
        self.start: Optional[dict[str, int]] = None
        self.peak: Optional[dict[str, int]] = None

    def sample(self, by_location: dict[str, dict[str, int]], process_peak: int) -> None:
        current = categorize(by_location)
        current["process_peak"] = process_peak
        if self.start is None:
            self.start = current
        total = sum(current[c] for c in CATEGORIES)
        if self.peak is None or total > sum(self.peak[c] for c in CATEGORIES):
            self.peak = current
        else:
            self.peak["process_peak"] = process_peak

    def all_ranks(self, group: comm.Group) -> dict[str, list[dict[str, int]]]:
        """Every rank's start and peak breakdown (a collective: every rank calls it)."""
        keys = list(self.start)
        mine = torch.tensor([[self.start[k] for k in keys], [self.peak[k] for k in keys]], dtype=torch.float64)
        everyone = torch.zeros(group.size * mine.numel(), dtype=torch.float64)
        comm.all_gather(everyone, mine.view(-1), group)
        rows = everyone.view(group.size, 2, len(keys))
        return {
            phase: [{k: int(rows[r, i, j]) for j, k in enumerate(keys)} for r in range(group.size)]
            for i, phase in enumerate(("start", "peak"))
        }


COLUMNS = {  # table header -> breakdown key
    "params": "parameters",
    "grads": "gradients",
    "optim": "optimizer_state",
    "comm_buf": "communication_buffers",
    "gathered": "gathered_units",
    "idle_buf": "idle_buffers",
    "device": "on_device",
    "host": "on_host",
    "nvme": "on_nvme",
    "proc_peak": "process_peak",
}


def format_table(breakdown: dict[str, list[dict[str, int]]]) -> str:
    """One row per (phase, rank), MiB; proc_peak is the process's peak (device memory on GPU, RSS on CPU)."""
    lines = ["model-state memory (MiB)", f"{'phase':<8}{'rank':>5}" + "".join(f"{h:>11}" for h in COLUMNS)]
    for phase, ranks in breakdown.items():
        for rank, row in enumerate(ranks):
            lines.append(f"{phase:<8}{rank:>5}" + "".join(f"{row.get(k, 0) / 2**20:>11.2f}" for k in COLUMNS.values()))
    return "\n".join(lines)
