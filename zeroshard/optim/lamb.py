"""LAMB (You et al. 2019) with per-parameter trust ratios that stay correct on ZeRO shards.

Under ZeRO a tensor handed to the optimizer is a flat shard holding pieces of many parameters.
The trust ratio needs each *original* parameter's norms, so the ZeRO layer passes a
:class:`ShardedNorms` (``sharded_norms=``) describing which ranges of which tensor belong to which
parameter, plus a function that sums partial squared norms across the shard group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch.optim import Optimizer

from ..comm import OneBitAllReduce


@dataclass
class ShardedNorms:
    """Where the parameters lie in the master shards an optimizer gets: per-parameter norms for Lamb, whole matrices
    for Muon (``zeroshard.optim.muon``)."""

    segments: dict[int, list[tuple[int, int, int]]]  # id(tensor) -> [(global slot id, start, numel)]
    slot_count: int
    all_reduce: Callable[[torch.Tensor], None]
    # id(tensor) -> every parameter of its flat group as (offset in the flat group, numel, shape)
    matrices: dict[int, list[tuple[int, int, tuple[int, ...]]]] = field(default_factory=dict)
    shard_start: dict[int, int] = field(default_factory=dict)  # id(tensor) -> its offset in the flat group
    # (tensor, values of this rank's shard) -> the flat group's values from every rank (an all-gather when sharded)
    whole: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lambda tensor, values: values
    # stage 0 (every rank holds whole tensors): the 1-bit all-reduce over those ranks, for the 1-bit optimizers that
    # average themselves (0/1 Adam, 1-bit LAMB); it owns their compression errors
    compressed: Optional[OneBitAllReduce] = None


class Lamb(Optimizer):
    # its trust ratio reads each parameter's whole norms (over every sub-group of an offloaded shard): the ZeRO layer
    # refuses homes that step a parameter in pieces
    needs_whole_parameter_norms = True

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        bias_correction: bool = True,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        sharded_norms: Optional[ShardedNorms] = None,
    ):
        super().__init__(
            params,
            dict(
                lr=lr,
                betas=tuple(betas),
                eps=eps,
                weight_decay=weight_decay,
                bias_correction=bias_correction,
                max_coeff=max_coeff,
                min_coeff=min_coeff,
            ),
        )
        self.sharded_norms = sharded_norms

    def _segments(self, p: torch.Tensor, fallback_id: int) -> list[tuple[int, int, int]]:
        if self.sharded_norms is None:
            return [(fallback_id, 0, p.numel())]
        return self.sharded_norms.segments[id(p)]

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        work = []  # (param, update, group, segments)
        slot_count = 0
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.lerp_(p.grad, 1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                c1 = 1 - beta1 ** state["step"] if group["bias_correction"] else 1.0
                c2 = 1 - beta2 ** state["step"] if group["bias_correction"] else 1.0
                update = (m / c1) / ((v / c2).sqrt_().add_(group["eps"]))
                if group["weight_decay"]:
                    update.add_(p, alpha=group["weight_decay"])
                segments = self._segments(p, slot_count)
                slot_count += len(segments)
                work.append((p, update, group, segments))
        total = self.sharded_norms.slot_count if self.sharded_norms else slot_count
        squares = torch.zeros(2, max(total, 1), dtype=torch.float32, device=work[0][0].device if work else "cpu")
        for p, update, _, segments in work:
            flat_p, flat_u = p.view(-1), update.view(-1)
            for slot, start, numel in segments:
                squares[0, slot] += flat_p[start : start + numel].float().pow(2).sum()
                squares[1, slot] += flat_u[start : start + numel].float().pow(2).sum()
        if self.sharded_norms is not None:
            self.sharded_norms.all_reduce(squares)
        norms = squares.sqrt()
        for p, update, group, segments in work:
            flat_p, flat_u = p.view(-1), update.view(-1)
            for slot, start, numel in segments:
                w_norm, u_norm = norms[0, slot], norms[1, slot]
                ratio = torch.where(
                    (w_norm > 0) & (u_norm > 0),
                    (w_norm / u_norm).clamp(group["min_coeff"], group["max_coeff"]),
                    torch.ones_like(w_norm),
                )
                flat_p[start : start + numel].add_(flat_u[start : start + numel] * ratio, alpha=-group["lr"])
        return loss
