"""The global gradient norm over one rank's reduced gradient shards, and the gradients pipeline stages share.

Each flat group's shard norm is squared and added to one row per group of ranks that completes it (:class:`NormAxes`):
row 0 for what the shard group (or nobody, at stage 0) completes, one row per split axis whose flat groups hold
different pieces on the ranks of that axis's group; each row is all-reduced over its groups, the rows summed, and the
sum all-reduced over a pipeline's stages. A flat group pipeline stages share (a tied embedding) is summed over the
stages first (:meth:`GradientNorm.sum_tied`) and counted by the first stage holding it only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

import torch

from .. import comm
from .flat_group import FlatGroup
from .grad_home import GradHome


@dataclass(frozen=True)
class NormAxes:
    """Where the pieces of the global gradient norm live. ``shard``: the group whose shards make up each flat group's
    gradient (None: every rank holds it whole, stage 0). ``split``: per split axis (``FlatLayout.split_axis``), the
    group over which those flat groups hold different pieces beyond ``shard`` (the others are replicated there:
    counted once): ``tp`` the tensor group; ``ep`` the expert group at stage 0 (sharded stages spread the experts'
    shards over ``shard`` already, and over the tensor group when the expert group spans it). ``stages``: under
    pipeline parallelism the pipe group, over which the stages' sums add up (a tied parameter counted once)."""

    shard: Optional[comm.Group] = None
    split: Mapping[str, comm.Group] = field(default_factory=dict)
    stages: Optional[comm.Group] = None  # the pipe group: each pipeline stage holds different parameters


class GradientNorm:
    """The squared global norm of a stack's trainable flat groups (``ties``: per flat group, the group of the pipeline
    stages sharing it, or None)."""

    def __init__(self, flat_groups: list[FlatGroup], axes: NormAxes, device: torch.device, ties: Optional[list] = None):
        self.axes, self.device = axes, device
        self.ties = ties or [None] * len(flat_groups)
        self._rows = [None, *axes.split]  # row 0: completed over the shard group; then one per split axis
        self._row_of_flat = torch.tensor(
            [self._rows.index(f.layout.split_axis) if f.layout.split_axis in axes.split else 0 for f in flat_groups],
            dtype=torch.long,
        )
        self._counted = torch.tensor([float(tie is None or tie.ranks[0] == comm.get_rank()) for tie in self.ties])

    def sum_tied(self, grads: list[GradHome]) -> None:
        """The reduced gradient shards of flat groups pipeline stages share, summed over the stages (their layouts
        are alike: ``planning.by_split_axis``), as one model's gradient of a tensor used twice is the sum of both
        uses."""
        for home, tie in zip(grads, self.ties):
            if tie is not None:
                shard = home.read()
                comm.all_reduce(shard, tie)
                if home.resident() is None:
                    home.write(0, shard)

    def squared(self, grads: list[GradHome], average_over: Optional[comm.Group] = None) -> torch.Tensor:
        """The squared global norm: over the data-parallel shards, then the split flat groups' pieces summed over
        their axis's group (tensor or expert parallelism), the replicated ones counted once, then over the stages of
        a pipeline. Each shard's norm is its home's (a spilled shard's was taken as its last contribution arrived).
        ``average_over``: each rank holds its own whole gradient (an optimizer that averages itself): every rank
        takes the mean of the ranks' squared norms, so overflow skips and clipping agree (the averaged gradient is
        never formed)."""
        squared = torch.zeros(len(self._rows), dtype=torch.float32, device=self.device)
        if grads:  # a rank without trainable parameters (a frozen pipeline stage) joins every all-reduce with zeros
            per_flat = torch.stack([home.norm() for home in grads]).pow(2)
            per_flat = per_flat * self._counted.to(per_flat.device)
            squared.index_add_(0, self._row_of_flat.to(per_flat.device), per_flat.to(self.device))
        if average_over is not None:
            comm.all_reduce(squared, average_over)
            squared.div_(average_over.size)
        elif self.axes.shard is not None:
            comm.all_reduce(squared, self.axes.shard)
        for row, group in enumerate(self.axes.split.values(), start=1):
            comm.all_reduce(squared[row : row + 1], group)
        total = squared.sum().reshape(1)
        if self.axes.stages is not None:
            comm.all_reduce(total, self.axes.stages)
        return total
