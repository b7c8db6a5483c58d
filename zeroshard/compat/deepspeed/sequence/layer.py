"""``deepspeed.sequence.layer.DistributedAttention``: any local attention over a sequence split across ranks, by
zeroshard's Ulysses exchange (``zeroshard.comm.autograd.all_to_all_in_group``): query, key and value trade their
sequence pieces for head pieces, the local attention runs on whole sequences of ``heads / P`` heads, and the output
trades back. Differentiable; every exchange counted by the ledger."""

from __future__ import annotations

from typing import Any, Callable

import torch

from zeroshard.comm.autograd import all_to_all_in_group
from zeroshard.comm.groups import as_group


class DistributedAttention(torch.nn.Module):
    """``local_attention(q, k, v, *args, **kwargs)`` over the ranks of ``sequence_process_group`` (a process group,
    ``None`` for the world, or a zeroshard group such as ``sequence_parallel_groups(P).sequence``, whose exchanges
    then count in its mesh's ledger, the engine's). ``scatter_idx`` is the heads dimension split across ranks,
    ``gather_idx`` the sequence dimension joined (DeepSpeed's defaults: 2 and 0, Megatron's [seq, batch, heads, dim]
    layout)."""

    def __init__(
        self,
        local_attention: Callable,
        sequence_process_group: Any,
        scatter_idx: int = 2,
        gather_idx: int = 0,
        sp_stream: Any = None,
    ):
        super().__init__()
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx, self.gather_idx = scatter_idx, gather_idx

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any):
        group = as_group(self.spg, "world" if self.spg is None else "sequence")
        scatter, gather = self.scatter_idx, self.gather_idx
        query, key, value = (all_to_all_in_group(t, group, scatter, gather) for t in (query, key, value))
        context = self.local_attn(query, key, value, *args, **kwargs)
        return all_to_all_in_group(context, group, self.gather_idx, self.scatter_idx)


__all__ = ["DistributedAttention"]
