"""Tiled compute over the sequence: an MLP applied to a long sequence one tile at a time.

An MLP acts on each token alone, so it can run on a sequence in tiles: the forward keeps only its input, and the
backward recomputes each tile's forward and backpropagates it before the next. The [tokens, intermediate]
activations (four times the hidden width in most models) then exist for one tile at a time instead of the whole
sequence, at the cost of a second forward. Parameter gradients arrive once per tile, from a backward nested in the
outer one; zeroshard's gradient reducer adds such contributions before it reduces (Note [gradient contributions] in
``zeroshard.zero.reducer``), as it does for reentrant activation checkpointing, so nothing has to be told.

Every rank must run as many tiles: under ZeRO-3 each tile's recompute gathers the MLP's weights, and ranks that
gathered a different number of times would wait on each other forever. :func:`agreed_tile_count` takes the
largest count over a group.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch

from .. import comm


def agreed_tile_count(sequence_length: int, tile_length: int, group: Optional[comm.Group] = None) -> int:
    """Tiles of at most ``tile_length`` tokens for ``sequence_length`` tokens, the largest count over ``group``
    (a collective when the group has more than one rank)."""
    if sequence_length < 0 or tile_length < 1:
        raise ValueError(f"agreed_tile_count: sequence_length {sequence_length} and tile_length {tile_length}")
    count = torch.tensor([max(1, math.ceil(sequence_length / tile_length))], dtype=torch.int64)
    if group is not None:
        comm.all_reduce(count, group, op="max")
    return int(count.item())


class TiledMLP(torch.autograd.Function):
    """``fn(module, x)`` on ``x`` in ``tiles`` pieces along the sequence (dim -2), keeping only ``x`` for backward
    (DeepSpeed's ``TiledMLP``: ``TiledMLP.apply(fn, module, x, tiles, compute_params)``; ``compute_params`` is
    accepted and not needed). ``fn`` must act on each token alone."""

    @staticmethod
    def forward(ctx, fn: Callable, module: Any, x: torch.Tensor, tiles: int, compute_params=None) -> torch.Tensor:
        if isinstance(tiles, bool) or not isinstance(tiles, int) or tiles < 1:
            raise ValueError(f"TiledMLP: tiles must be an integer >= 1, got {tiles!r}")
        ctx.fn, ctx.module, ctx.tiles = fn, module, tiles
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([fn(module, piece) for piece in x.chunk(tiles, dim=-2)], dim=-2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        x_grad = torch.zeros_like(x) if ctx.needs_input_grad[2] else None
        for index, (piece, grad_piece) in enumerate(zip(x.chunk(ctx.tiles, dim=-2), grad.chunk(ctx.tiles, dim=-2))):
            piece = piece.detach().requires_grad_(x_grad is not None)
            with torch.enable_grad():
                out = ctx.fn(ctx.module, piece)
            torch.autograd.backward(out, grad_piece)  # parameter gradients accumulate tile by tile
            if x_grad is not None:
                start = index * x.chunk(ctx.tiles, dim=-2)[0].shape[-2]
                x_grad.narrow(-2, start, piece.shape[-2]).copy_(piece.grad)
        return None, None, x_grad, None, None


def tiled_mlp(module: torch.nn.Module, x: torch.Tensor, tiles: int, fn: Optional[Callable] = None) -> torch.Tensor:
    """``module(x)`` computed in ``tiles`` sequence tiles (``fn(module, x)`` instead of the module's forward when
    given): the same output, with one tile's intermediate activations alive at a time in backward."""
    return TiledMLP.apply(fn or (lambda m, t: m(t)), module, x, tiles, None)
