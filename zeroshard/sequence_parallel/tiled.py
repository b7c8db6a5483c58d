"""Tiled compute over the sequence: an MLP, or the LM head and its loss, applied to a long sequence one tile at a time.

An MLP acts on each token alone, so it can run on a sequence in tiles: the forward keeps only its input, and the
backward recomputes each tile's forward and backpropagates it before the next. The [tokens, intermediate]
activations (four times the hidden width in most models) then exist for one tile at a time instead of the whole
sequence, at the cost of a second forward. Parameter gradients arrive once per tile, from a backward nested in the
outer one; zeroshard's gradient reducer adds such contributions before it reduces (Note [gradient contributions] in
``zeroshard.zero.reducer``), as it does for reentrant activation checkpointing, so nothing has to be told.

The LM head and its loss are the largest of all at long sequences ([tokens, vocabulary] logits):
:class:`TiledFusedLogitsLoss` computes the loss tile by tile without keeping any logits, and recomputes each tile's
logits in backward (DeepSpeed's version backpropagates inside its forward instead; that hands the head's gradient to
the optimizer before the engine's backward starts, outside the loss scale and the gradient reduction).

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


class TiledFusedLogitsLoss(torch.autograd.Function):
    """``fn(module, x, y[, mask])`` (a loss over the tile's tokens, e.g. the LM head and cross-entropy) on ``tiles``
    tiles of the flattened tokens of ``x`` [batch, sequence, ...] and ``y`` [batch, sequence, ...], combined by
    ``output_reduction`` (``"mean"`` of the tiles' losses, or ``"sum"``: use ``"sum"`` and divide yourself when tiles
    hold different numbers of counted tokens). No tile's logits outlive it: backward recomputes them one tile at a
    time. DeepSpeed's signature: ``apply(fn, module, x, y, mask, tiles, compute_params, output_reduction)``;
    ``compute_params`` is accepted and not needed."""

    @staticmethod
    def forward(ctx, fn, module, x, y, mask, tiles, compute_params=None, output_reduction="mean"):
        if output_reduction not in ("mean", "sum"):
            raise ValueError(f'TiledFusedLogitsLoss: output_reduction {output_reduction!r}; use "mean" or "sum"')
        if isinstance(tiles, bool) or not isinstance(tiles, int) or tiles < 1:
            raise ValueError(f"TiledFusedLogitsLoss: tiles must be an integer >= 1, got {tiles!r}")
        if x.dim() < 2 or y.dim() < 2 or x.shape[:2] != y.shape[:2]:
            raise ValueError(
                f"TiledFusedLogitsLoss: x {list(x.shape)} and y {list(y.shape)} need the same [batch, sequence] dims"
            )
        if mask is not None and tuple(mask.shape) != tuple(x.shape[:2]):
            raise ValueError(f"TiledFusedLogitsLoss: mask {list(mask.shape)} must be [batch, sequence] of x")
        ctx.fn, ctx.module, ctx.tiles, ctx.reduction = fn, module, tiles, output_reduction
        ctx.has_mask = mask is not None
        ctx.save_for_backward(x, y, *([mask] if mask is not None else []))
        with torch.no_grad():
            losses = [fn(module, *args) for args in _token_tiles(x, y, mask, tiles)]
        total = torch.stack(losses).sum()
        return total / len(losses) if output_reduction == "mean" else total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, y, *rest = ctx.saved_tensors
        mask = rest[0] if ctx.has_mask else None
        pieces = _token_tiles(x, y, mask, ctx.tiles)
        scale = grad / len(pieces) if ctx.reduction == "mean" else grad
        x_grad = torch.zeros_like(x).reshape(-1, *x.shape[2:]) if ctx.needs_input_grad[2] else None
        start = 0
        for x_piece, *others in pieces:
            x_piece = x_piece.detach().requires_grad_(x_grad is not None)
            with torch.enable_grad():
                loss = ctx.fn(ctx.module, x_piece, *others)
            torch.autograd.backward(loss, scale)  # this tile's logits live only inside this call
            if x_grad is not None:
                x_grad[start : start + x_piece.shape[0]].copy_(x_piece.grad)
            start += x_piece.shape[0]
        return None, None, None if x_grad is None else x_grad.view_as(x), None, None, None, None, None


def _token_tiles(x: torch.Tensor, y: torch.Tensor, mask: Optional[torch.Tensor], tiles: int) -> list[tuple]:
    """(x, y[, mask]) tiles of the flattened [batch x sequence] tokens (at most ``tiles``; the last may be shorter)."""
    flat = [x.reshape(-1, *x.shape[2:]), y.reshape(-1, *y.shape[2:])]
    if mask is not None:
        flat.append(mask.reshape(-1))
    return list(zip(*(t.chunk(tiles, dim=0) for t in flat)))
