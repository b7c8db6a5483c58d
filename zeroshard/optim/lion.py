"""Lion (Chen et al. 2023): sign of an interpolated momentum, decoupled weight decay."""

from __future__ import annotations

import torch
from torch.optim import Optimizer


class Lion(Optimizer):
    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0):
        if lr <= 0:
            raise ValueError(f"Lion lr must be > 0, got {lr}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            avgs = [self.state[p].setdefault("exp_avg", torch.zeros_like(p)) for p in params]
            if group["weight_decay"]:
                torch._foreach_mul_(params, 1 - group["lr"] * group["weight_decay"])
            updates = torch._foreach_lerp(avgs, grads, 1 - beta1)
            torch._foreach_sign_(updates)
            torch._foreach_add_(params, updates, alpha=-group["lr"])
            torch._foreach_lerp_(avgs, grads, 1 - beta2)
        return loss
