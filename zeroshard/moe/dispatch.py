"""Token dispatch over an expert-parallel group: rows out to the ranks holding their experts and back.

:class:`ExpertDispatch` is the communication half of an expert-parallel layer: ``send`` exchanges the per-expert
counts first (one all-to-all of ``E`` integers), then the rows in counts that differ per rank pair; ``combine``
sends the experts' outputs back along the same counts and adds each token's ``k`` outputs, weighted, in expert order
(as a one-process layer accumulates them). Autograd sends each row's gradient back the way it came. With one rank
in the group both are local.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .. import comm
from ..comm.autograd import all_to_all_rows_in_group
from ..comm.collectives import all_to_all
from .routing import TokenRoute, regroup_by_expert


@dataclass(frozen=True)
class Dispatched:
    """What ``combine`` needs to bring one ``send``'s rows home."""

    route: TokenRoute
    regroup: torch.Tensor  # received rows, source-major -> expert-major
    sent: list[int]  # rows sent to each rank
    received: list[int]  # rows received from each rank
    tokens: int


class ExpertDispatch:
    """Sends rows for ``num_experts`` experts split in order over ``group`` (``num_experts / group.size`` each)."""

    def __init__(self, group: comm.Group, num_experts: int):
        if num_experts % group.size:
            raise ValueError(
                f"{num_experts} experts cannot be split evenly over an expert-parallel group of {group.size} ranks"
            )
        self.group = group
        self.num_experts = num_experts
        self.local_experts = num_experts // group.size

    def send(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, kept: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, list[int], Dispatched]:
        """The rows this rank's experts compute (expert-major), the rows per local expert, and the routing state;
        ``kept`` (capacity gating): only those choices are sent."""
        route = TokenRoute.of(top_k_index, self.num_experts, kept)
        received_counts = torch.empty_like(route.counts)
        if self.group.size > 1:
            all_to_all(received_counts, route.counts, self.group)  # the count exchange: E integers per rank
        else:
            received_counts.copy_(route.counts)
        received_counts = received_counts.view(self.group.size, self.local_experts)
        sent = route.per_rank(self.group.size)
        received = received_counts.sum(1).tolist()
        rows = all_to_all_rows_in_group(hidden[route.tokens], self.group, received, sent)
        regroup, per_expert = regroup_by_expert(received_counts.cpu())
        regroup = regroup.to(rows.device)
        return rows[regroup], per_expert, Dispatched(route, regroup, sent, received, hidden.shape[0])

    def combine(self, outputs: torch.Tensor, top_k_weights: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """Each token's output: the sum of its experts' ``outputs`` weighted by ``top_k_weights`` (``[T, k]``)."""
        home = torch.empty_like(outputs).index_copy(0, dispatched.regroup, outputs)  # back to source-major
        returned = all_to_all_rows_in_group(home, self.group, dispatched.sent, dispatched.received)
        route = dispatched.route
        weights = top_k_weights.reshape(-1)[route.order].unsqueeze(-1)
        result = returned.new_zeros((dispatched.tokens, outputs.shape[-1]))
        return result.index_add(0, route.tokens, (returned * weights).to(result.dtype))
