"""Capacity-gated top-1 and top-2 routing as DeepSpeed's MoE layer computes it (GShard's gate): pure tensor
arithmetic on one rank's router logits, no communication.

Each expert takes at most ``capacity = ceil(tokens / experts * capacity_factor)`` choices (``2 x capacity_factor``
for top-2), floored at ``min_capacity``; with ``drop_tokens`` the choices past it are dropped (their token keeps the
other choice, or passes through as zero). Which choices survive follows DeepSpeed exactly: top-1 keeps, per expert,
the ``capacity`` tokens of highest priority (random priority under Random Token Selection, ``use_rts``); top-2 keeps
first choices before second ones, each in token order. Without ``drop_tokens`` every choice is kept (DeepSpeed
raises the capacity to the largest count over the expert group, which keeps them all). The noise follows
DeepSpeed's draws (``RSample``: Gumbel noise on the top-1 selection; top-2's second choice sampled with Gumbel
noise unless ``second_expert_sampling`` is off), so the same seed routes the same way.

The result is per (token, choice): the expert, the combine weight (0 when dropped) and whether it is kept, with
the load-balancing loss and DeepSpeed's ``exp_counts`` (choices per expert before dropping).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")


@dataclass(frozen=True)
class Gated:
    experts: torch.Tensor  # [T, k] the expert of each choice
    weights: torch.Tensor  # [T, k] float32 combine weight of each choice (0 where dropped)
    kept: torch.Tensor  # [T, k] bool
    aux_loss: torch.Tensor  # the load-balancing loss (DeepSpeed's l_aux)
    counts: torch.Tensor  # [E] choices per expert before dropping (DeepSpeed's exp_counts)


def capacity(tokens: int, experts: int, capacity_factor: float, min_capacity: int) -> int:
    """Choices one expert takes: ``ceil(tokens / experts * capacity_factor)``, at least ``min_capacity``."""
    return max(math.ceil(tokens / experts * capacity_factor), min_capacity)


def _gumbel(shape, device) -> torch.Tensor:
    zero, one = torch.tensor(0.0, device=device), torch.tensor(1.0, device=device)
    return torch.distributions.gumbel.Gumbel(zero, one).rsample(shape)


def _uniform(shape, low: float, high: float, device) -> torch.Tensor:
    return torch.distributions.uniform.Uniform(
        torch.tensor(low, device=device), torch.tensor(high, device=device)
    ).rsample(shape)


def jitter(x: torch.Tensor, epsilon: float = 1e-2) -> torch.Tensor:
    """The ``Jitter`` policy: the router's input times uniform noise in [1 - epsilon, 1 + epsilon]."""
    return x * _uniform(x.shape, 1.0 - epsilon, 1.0 + epsilon, x.device)


def top1(
    logits: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    used_token: Optional[torch.Tensor] = None,
    noisy_gate_policy: Optional[str] = None,
    drop_tokens: bool = True,
    use_rts: bool = True,
) -> Gated:
    """Switch routing: each token's most probable expert, weighted by its probability."""
    gates = F.softmax(logits, dim=1)
    tokens, experts = gates.shape
    chooser = logits + _gumbel(logits.shape, logits.device) if noisy_gate_policy == "RSample" else gates
    first = torch.argmax(chooser, dim=1)
    mask = F.one_hot(first, num_classes=experts)
    if used_token is not None:
        mask = mask * used_token.reshape(-1, 1).to(mask.dtype)
    counts = mask.sum(dim=0).detach()
    aux_loss = torch.sum(gates.mean(dim=0) * mask.float().mean(dim=0)) * experts
    if tokens < min_capacity:
        raise ValueError(
            f"top-1 gating of {tokens} tokens with min_capacity {min_capacity}: the micro-batch must hold at least "
            "min_capacity tokens (set min_capacity to 0 or use a larger batch), as DeepSpeed requires"
        )
    if drop_tokens:
        limit = min(capacity(tokens, experts, capacity_factor, min_capacity), tokens)
        priority = mask * _uniform(mask.shape, 0.0, 1.0, logits.device) if use_rts else mask
        chosen = torch.zeros_like(mask).scatter_(0, torch.topk(priority, k=limit, dim=0)[1], 1)
        mask = mask * chosen
    kept = mask.sum(dim=1) > 0
    weights = (gates * mask.float()).sum(dim=1)
    return Gated(first.unsqueeze(1), weights.unsqueeze(1), kept.unsqueeze(1), aux_loss, counts)


def top2(
    logits: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    second_expert_sampling: bool = True,
) -> Gated:
    """GShard routing: the most probable expert and a second one (sampled with Gumbel noise, or the second most
    probable), each weighted by its probability over the two kept."""
    gates = F.softmax(logits, dim=1)
    tokens, experts = gates.shape
    first = torch.argmax(gates, dim=1)
    mask1 = F.one_hot(first, num_classes=experts)
    if second_expert_sampling:
        logits = logits + _gumbel(logits.shape, logits.device)
    second = torch.argmax(logits.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = F.one_hot(second, num_classes=experts)
    place1 = torch.cumsum(mask1, dim=0) - 1
    place2 = torch.cumsum(mask2, dim=0) - 1 + mask1.sum(dim=0, keepdim=True)  # after every first choice
    aux_loss = torch.mean(gates.mean(dim=0) * mask1.float().mean(dim=0)) * experts * experts
    counts = (mask1 + mask2).sum(dim=0).detach()
    if drop_tokens:
        limit = capacity(tokens, experts, capacity_factor * 2, min_capacity)
        mask1 = mask1 * (place1 < limit)
        mask2 = mask2 * (place2 < limit)
    gate1 = (gates * mask1.float()).sum(dim=1)
    gate2 = (gates * mask2.float()).sum(dim=1)
    total = torch.clamp(gate1 + gate2, min=torch.finfo(gate1.dtype).eps)
    weights = torch.stack([gate1 / total, gate2 / total], dim=1)
    kept = torch.stack([mask1.sum(dim=1) > 0, mask2.sum(dim=1) > 0], dim=1)
    return Gated(torch.stack([first, second], dim=1), weights, kept, aux_loss, counts)
