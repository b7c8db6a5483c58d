"""The tensor-parallel layers: each holds its rank's slice of a weight.

Every rank of the tensor-parallel group runs the same forward on the same inputs; column-parallel
outputs stay split (the attention / MLP code in between works on this rank's heads or units), and
the row-parallel and vocabulary layers bring every rank back to the full, identical activation. Their
communication is differentiable (:mod:`zeroshard.comm.autograd`): a column layer's input gradient is summed
over the group in backward, so the same layers train.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .. import comm
from ..comm.autograd import copy_to_group, gather_from_group, reduce_from_group
from ..partition import TensorSplit, linear_splits


class ColumnParallelLinear(nn.Module):
    """Y_i = X W_i^T + b_i: this rank's output features; no communication forward, the input's gradient summed
    over the group backward. ``fused`` and ``transposed`` say how the full weight was cut (see
    :class:`~zeroshard.partition.TensorSplit`)."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor],
        group: comm.Group,
        fused: int = 1,
        transposed: bool = False,
    ):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.group = group
        self.fused, self.transposed = fused, transposed

    def splits(self) -> dict[str, TensorSplit]:
        """How each parameter's full tensor is cut over the group: the output features, per fused projection."""
        return linear_splits("column", self.group.size, self.fused, self.transposed, self.bias is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_group(x, self.group), self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"local in={self.weight.shape[1]}, out={self.weight.shape[0]}"


class RowParallelLinear(nn.Module):
    """Y = sum_i X_i W_i^T + b: this rank's input features, partial sums all-reduced, the bias added once (it is
    replicated)."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], group: comm.Group, transposed: bool = False):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.group = group
        self.transposed = transposed

    def splits(self) -> dict[str, TensorSplit]:
        """The weight's input features are cut over the group."""
        return linear_splits("row", self.group.size, transposed=self.transposed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_group(F.linear(x, self.weight), self.group)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"local in={self.weight.shape[1]}, out={self.weight.shape[0]}, all-reduce over {self.group.size}"


class VocabParallelEmbedding(nn.Module):
    """Rows [start, stop) of the vocabulary: ids outside them look up zeros, and the sum over ranks is the
    full embedding."""

    def __init__(self, weight: torch.Tensor, start: int, stop: int, group: comm.Group):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start, self.stop, self.group = start, stop, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.stop)
        local = (ids - self.start).masked_fill(outside, 0)
        return reduce_from_group(F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0), self.group)

    def extra_repr(self) -> str:
        return f"vocabulary rows [{self.start}, {self.stop}) of {self.weight.shape[0]} per rank"


class VocabParallelHead(nn.Module):
    """Logits of this rank's vocabulary slice, all-gathered so every rank returns the full logits."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], vocab: int, group: comm.Group):
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.vocab, self.group = vocab, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = F.linear(copy_to_group(x, self.group), self.weight, self.bias)
        return gather_from_group(local, self.group)[..., : self.vocab].contiguous()  # losses view it flat

    def extra_repr(self) -> str:
        return f"vocabulary {self.vocab}, {self.weight.shape[0]} rows per rank, all-gather over {self.group.size}"
