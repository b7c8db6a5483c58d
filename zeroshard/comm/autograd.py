"""Collectives that autograd differentiates: the tensor-parallel operators of Megatron-LM (its ``f`` and ``g``), over
zeroshard's counted collectives.

A column-parallel layer reads the full activation and writes this rank's slice of the output features; a
row-parallel layer reads a slice and writes partial sums. So the activation entering a tensor-parallel region
is the same on every rank while each rank's gradient for it covers only its own slice's contribution
(:func:`copy_to_group`: identity forward, all-reduce backward), and the partial sums leaving it are added up
forward while the gradient entering it is already the same on every rank (:func:`reduce_from_group`:
all-reduce forward, identity backward). :func:`gather_from_group` concatenates slices along a
dimension (a vocabulary-parallel head's logits) and hands each rank its slice of the gradient back;
:func:`scatter_to_group` is its mirror (each rank keeps its block of a shared tensor, the gradient's blocks gathered
back).

Sequence parallelism (Ulysses) re-cuts activations between the sequence and the heads: :func:`all_to_all_in_group`
splits one dimension over the ranks and joins another (its backward is the same exchange the other way), and
:func:`gather_in_group` stacks every rank's value, its backward summing the gradients every rank computed for each
slot (as ``torch.distributed.nn.functional.all_gather``: a loss every rank computes from the gathered values sends
each rank's value the sum of their gradients).

Expert parallelism sends each token to the ranks holding its experts: :func:`all_to_all_rows_in_group` exchanges
rows in counts that differ per rank pair (its backward is the same exchange with the counts swapped). When an expert
group takes in tensor ranks, each routes its block of the tokens they share (:func:`scatter_to_group`) and the
outputs are joined back (:func:`gather_from_group` along the rows).

Every collective goes through :mod:`zeroshard.comm.collectives`, so the ledger counts tensor-parallel bytes like
any others. With one rank in the group each is the identity.

In compiled code each is one node of the graph (Note [collectives in compiled code] in ``graph_ops.py``).
"""

from __future__ import annotations

from typing import Optional

import torch

from .graph_ops import all_gather_stacked, all_reduce_sum, all_to_all_rows, all_to_all_stacked
from .groups import Group


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_reduce_sum(grad, ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        return all_reduce_sum(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _GatherFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, dim: int, total: int) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.total = group, dim, total
        return _gather_along(x, group, dim, total)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _block(grad, ctx.group, ctx.dim, ctx.total).contiguous(), None, None, None


class _ScatterToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.total = group, dim, x.shape[dim]
        return _block(x, group, dim, x.shape[dim]).contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather_along(grad, ctx.group, ctx.dim, ctx.total), None, None


def _block_sizes(total: int, parts: int) -> list[int]:
    """How ``total`` elements split into ``parts`` blocks, as ``torch.tensor_split`` cuts them (the first ``total %
    parts`` blocks one larger)."""
    base, extra = divmod(total, parts)
    return [base + 1] * extra + [base] * (parts - extra)


def _block(x: torch.Tensor, group: Group, dim: int, total: int) -> torch.Tensor:
    """This rank's block of ``x`` (``total`` long along ``dim``)."""
    sizes = _block_sizes(total, group.size)
    return x.narrow(dim, sum(sizes[: group.rank]), sizes[group.rank])


def _gather_along(x: torch.Tensor, group: Group, dim: int, total: int) -> torch.Tensor:
    """Every rank's block along ``dim`` joined in rank order (blocks as :func:`_block_sizes` cuts ``total``; a
    shorter one travels padded to the longest)."""
    dim %= x.dim()
    sizes = _block_sizes(total, group.size)
    local = x.contiguous()
    if x.shape[dim] < sizes[0]:
        padding = list(x.shape)
        padding[dim] = sizes[0] - x.shape[dim]
        local = torch.cat([local, x.new_zeros(padding)], dim)
    gathered = all_gather_stacked(local, group, group.size)
    if sizes[-1] == sizes[0]:
        return gathered.movedim(0, dim).flatten(dim, dim + 1)
    return torch.cat([gathered[i].narrow(dim, 0, n) for i, n in enumerate(sizes)], dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, split_dim: int, join_dim: int) -> torch.Tensor:
        ctx.group, ctx.split_dim, ctx.join_dim = group, split_dim, join_dim
        return _exchange(x, group, split_dim, join_dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.group, ctx.join_dim, ctx.split_dim), None, None, None


def _exchange(x: torch.Tensor, group: Group, split_dim: int, join_dim: int) -> torch.Tensor:
    """Piece j of ``x`` along ``split_dim`` goes to the group's j-th rank; the pieces received are joined along
    ``join_dim`` in rank order."""
    if x.shape[split_dim] % group.size:
        raise ValueError(
            f"all_to_all over {group.size} ranks: dimension {split_dim} of {list(x.shape)} does not divide evenly"
        )
    received = all_to_all_stacked(torch.stack(x.chunk(group.size, dim=split_dim)), group)
    return torch.cat(received.unbind(0), dim=join_dim)


class _AllToAllUneven(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        return _exchange_rows(x, group, output_splits, input_splits)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange_rows(grad, ctx.group, ctx.input_splits, ctx.output_splits), None, None, None


def _exchange_rows(x: torch.Tensor, group: Group, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
    return all_to_all_rows(x, group, output_splits, input_splits)


class _GatherInGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return all_gather_stacked(x, group, group.size)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_reduce_sum(grad, ctx.group)[ctx.group.rank], None


def copy_to_group(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Identity forward; backward all-reduces the gradient over ``group`` (enter a tensor-parallel region)."""
    return x if group.size == 1 else _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-reduce forward; identity backward (leave a tensor-parallel region through a row-parallel layer)."""
    return x if group.size == 1 else _ReduceFromGroup.apply(x, group)


def gather_from_group(x: torch.Tensor, group: Group, dim: int = -1, total: Optional[int] = None) -> torch.Tensor:
    """Every rank's ``x`` joined along ``dim`` in rank order (a vocabulary-parallel head's logits along the last
    dimension; ``total``: the joined length when the blocks differ, as :func:`scatter_to_group` cut them); backward
    keeps this rank's block of the gradient, which must be the same on every rank."""
    if group.size == 1:
        return x
    return _GatherFromGroup.apply(x, group, dim, x.shape[dim] * group.size if total is None else total)


def scatter_to_group(x: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
    """This rank's block of ``x`` along ``dim`` (the same on every rank; blocks as ``torch.tensor_split`` cuts
    them): each rank of a tensor group routes its slice of the tokens they share. Backward gathers every rank's
    block of the gradient, so ``x``'s gradient is whole again on every rank."""
    return x if group.size == 1 else _ScatterToGroup.apply(x, group, dim)


def all_to_all_in_group(x: torch.Tensor, group: Group, split_dim: int, join_dim: int) -> torch.Tensor:
    """Split ``x`` along ``split_dim`` over the group's ranks and join what arrives along ``join_dim`` (Ulysses:
    sequence pieces with all heads in, the whole sequence with a slice of the heads out); backward exchanges back."""
    return x if group.size == 1 else _AllToAll.apply(x, group, split_dim, join_dim)


def all_to_all_rows_in_group(
    x: torch.Tensor, group: Group, output_splits: list[int], input_splits: list[int]
) -> torch.Tensor:
    """Send ``input_splits[j]`` consecutive rows of ``x`` to the group's j-th rank and receive ``output_splits[j]``
    from it (any counts, 0 included; every rank's counts must mirror its peers'): an expert layer's token dispatch.
    Backward sends each row's gradient back where the row came from."""
    if group.size == 1:
        return x
    return _AllToAllUneven.apply(x, group, list(output_splits), list(input_splits))


def gather_in_group(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Every rank's ``x`` stacked along a new first dimension, in rank order; backward sums each slot's gradient over
    the ranks and hands this rank its slot's sum."""
    return x.unsqueeze(0) if group.size == 1 else _GatherInGroup.apply(x, group)
