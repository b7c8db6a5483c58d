"""LAMB (You et al. 2019) with per-parameter trust ratios that stay correct on ZeRO shards.

Under ZeRO a tensor handed to the optimizer is a flat shard holding pieces of many parameters. The trust ratio
needs each *original* parameter's norms: Lamb declares so (``zero_needs``) and reads the shards'
:class:`~zeroshard.optim.contract.ShardLayout`, which says which ranges of which tensor belong to which parameter
and completes the partial sums of squares over the ranks holding the rest of each parameter.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.optim import Optimizer

from .contract import LayoutAware, Needs, ShardLayout


class Lamb(LayoutAware, Optimizer):
    zero_needs = Needs(parameter_norms=True)

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
        layout: Optional[ShardLayout] = None,
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
        self.layout = layout

    def _segments(self, p: torch.Tensor, fallback_id: int) -> list[tuple[int, int, int]]:
        if self.layout is None:
            return [(fallback_id, 0, p.numel())]
        return self.layout.segments(p)

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
        total = self.layout.slot_count if self.layout is not None else slot_count
        squares = torch.zeros(2, max(total, 1), dtype=torch.float32, device=work[0][0].device if work else "cpu")
        for p, update, _, segments in work:
            flat_p, flat_u = p.view(-1), update.view(-1)
            for slot, start, numel in segments:
                squares[0, slot] += flat_p[start : start + numel].float().pow(2).sum()
                squares[1, slot] += flat_u[start : start + numel].float().pow(2).sum()
        if self.layout is not None:
            self.layout.complete_norms(squares)
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
