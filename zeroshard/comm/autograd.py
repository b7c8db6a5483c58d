"""Collectives that autograd differentiates: the tensor-parallel operators of Megatron-LM (its ``f`` and ``g``), over
zeroshard's counted collectives.

A column-parallel layer reads the full activation and writes this rank's slice of the output features; a
row-parallel layer reads a slice and writes partial sums. So the activation entering a tensor-parallel region
is the same on every rank while each rank's gradient for it covers only its own slice's contribution
(:func:`copy_to_group`: identity forward, all-reduce backward), and the partial sums leaving it are added up
forward while the gradient entering it is already the same on every rank (:func:`reduce_from_group`:
all-reduce forward, identity backward). :func:`gather_from_group` concatenates slices along the last
dimension (a vocabulary-parallel head's logits) and hands each rank its slice of the gradient back.

Every collective goes through :mod:`zeroshard.comm.collectives`, so the ledger counts tensor-parallel bytes like
any others. With one rank in the group each is the identity.
"""

from __future__ import annotations

import torch

from .collectives import all_gather, all_reduce
from .groups import Group


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        all_reduce(grad, ctx.group)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        summed = x.contiguous().clone()
        all_reduce(summed, group)
        return summed

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _GatherFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group, ctx.width = group, x.shape[-1]
        local = x.contiguous()
        gathered = local.new_empty((group.size, *local.shape))
        all_gather(gathered, local, group)
        return gathered.movedim(0, -2).flatten(-2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start = ctx.group.rank * ctx.width
        return grad[..., start : start + ctx.width].contiguous(), None


def copy_to_group(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Identity forward; backward all-reduces the gradient over ``group`` (enter a tensor-parallel region)."""
    return x if group.size == 1 else _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-reduce forward; identity backward (leave a tensor-parallel region through a row-parallel layer)."""
    return x if group.size == 1 else _ReduceFromGroup.apply(x, group)


def gather_from_group(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dimension, in rank order; backward keeps this rank's slice."""
    return x if group.size == 1 else _GatherFromGroup.apply(x, group)
