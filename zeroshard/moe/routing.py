"""Where each token goes: the pure arithmetic of routing tokens to experts split over an expert-parallel group.

A router picks ``k`` experts per token (``top_k_index``, ``[T, k]``). With ``E`` experts split over ``P`` ranks in
order (rank ``r`` holds experts ``r * E / P`` up to ``(r + 1) * E / P``), every (token, choice) pair is one *row*
sent to the rank holding its expert. :class:`TokenRoute` sorts the rows by expert (a stable sort, so each expert
sees its tokens in token order, as a one-process layer loops over them), which makes the rows for each rank
contiguous: the per-rank counts are the all-to-all's splits. No token is dropped (dropless routing) unless the
gate says so (capacity gating: the choices not ``kept`` stay home); an expert no row goes to is normal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class TokenRoute:
    """One layer's routing on one rank: ``order`` (rows sorted by expert; row ``i`` of the sort is (token
    ``order[i] // k``, choice ``order[i] % k``)) and ``counts`` (rows per expert, ``[E]``)."""

    order: torch.Tensor
    counts: torch.Tensor
    top_k: int

    @classmethod
    def of(cls, top_k_index: torch.Tensor, num_experts: int, kept: Optional[torch.Tensor] = None) -> "TokenRoute":
        """The route of ``top_k_index``; ``kept`` (``[T, k]`` bool, capacity gating): only those choices travel."""
        if top_k_index.dim() != 2:
            raise ValueError(f"top_k_index must be [tokens, k], got shape {list(top_k_index.shape)}")
        flat = top_k_index.reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= num_experts):
            raise ValueError(
                f"expert indices must lie in [0, {num_experts}), got [{int(flat.min())}, {int(flat.max())}]"
            )
        if kept is not None:  # dropped choices sort last, past every expert, and are left out
            flat = torch.where(kept.reshape(-1), flat, torch.full_like(flat, num_experts))
        counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts]
        order = torch.argsort(flat, stable=True)[: int(counts.sum())]
        return cls(order=order, counts=counts, top_k=top_k_index.shape[1])

    @property
    def tokens(self) -> torch.Tensor:
        """The token of each sorted row."""
        return torch.div(self.order, self.top_k, rounding_mode="floor")

    def per_rank(self, ranks: int) -> list[int]:
        """Rows for each rank of a group of ``ranks`` holding the experts in order."""
        return self.counts.view(ranks, -1).sum(1).tolist()


def regroup_by_expert(received_counts: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """Rows received from each source rank arrive source-major (``received_counts[j, e]``: rows from rank ``j`` for
    local expert ``e``). Returns the permutation that puts them expert-major (each expert's rows together, sources in
    rank order) and the rows per local expert."""
    sources, local = received_counts.shape
    expert_of_row = torch.arange(local).repeat(sources).repeat_interleave(received_counts.reshape(-1))
    return torch.argsort(expert_of_row, stable=True), received_counts.sum(0).tolist()
