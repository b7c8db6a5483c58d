"""Tiled compute over the sequence: an MLP, or the LM head and its loss, applied to a long sequence one tile at a time.

:func:`sequence_tiled_compute` is the general form (any function of [batch, tokens, ...] tensors that acts on
each token alone); :class:`TiledMLP` is it applied to an MLP.

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


class SequenceTiledCompute(torch.autograd.Function):
    """The tiled computation behind :func:`sequence_tiled_compute` (DeepSpeed's ``SequenceTiledCompute``): forward
    without a graph, backward recomputing one tile at a time. Its ``apply`` takes the dict keys and values flat, as
    autograd functions must; call :func:`sequence_tiled_compute`."""

    @staticmethod
    def forward(
        ctx, fn, seqlen, shards, keys_to_shard, keys_to_pass, grad_key, compute_params, out_dim, reduction, *args
    ):
        _check_tiles("sequence_tiled_compute", shards)
        if reduction not in (None, "mean", "sum"):
            raise ValueError(f'sequence_tiled_compute: output_reduction {reduction!r}; use None, "mean" or "sum"')
        keys = list(keys_to_shard) + list(keys_to_pass)
        if grad_key not in keys_to_shard:
            raise ValueError(
                f"sequence_tiled_compute: grad_requiring_tensor_key {grad_key!r} is not one of {keys_to_shard}"
            )
        tensors = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.save_for_backward(*(args[i] for i in tensors))
        ctx.tensor_slots, ctx.others = tensors, [None if torch.is_tensor(a) else a for a in args]
        ctx.fn, ctx.keys, ctx.sharded, ctx.grad_key = fn, keys, len(keys_to_shard), grad_key
        ctx.step, ctx.out_dim, ctx.reduction = math.ceil(seqlen / shards), out_dim, reduction
        with torch.no_grad():
            outputs = [fn(**tile) for tile in _sequence_tiles(dict(zip(keys, args)), ctx.sharded, ctx.step, seqlen)]
        joined = torch.stack(outputs) if out_dim == 0 else torch.cat(outputs, dim=out_dim)
        ctx.tiles = len(outputs)
        if reduction is None:
            return joined
        return joined.mean() if reduction == "mean" else joined.sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        args = list(ctx.others)
        for slot, tensor in zip(ctx.tensor_slots, ctx.saved_tensors):
            args[slot] = tensor
        named = dict(zip(ctx.keys, args))
        whole = named[ctx.grad_key]
        named[ctx.grad_key] = whole.detach()
        seqlen = whole.shape[1]
        whole_grad = torch.zeros_like(whole)
        for index, tile in enumerate(_sequence_tiles(named, ctx.sharded, ctx.step, seqlen)):
            piece = tile[ctx.grad_key].requires_grad_(True)
            with torch.enable_grad():
                out = ctx.fn(**tile)
            if ctx.reduction is not None:
                tile_grad = grad / ctx.tiles if ctx.reduction == "mean" else grad
                tile_grad = tile_grad.expand_as(out)
            elif ctx.out_dim == 0:
                tile_grad = grad[index]
            else:
                tile_grad = grad.narrow(ctx.out_dim, index * ctx.step, out.shape[ctx.out_dim])
            torch.autograd.backward(out, tile_grad)  # parameter gradients accumulate tile by tile
            whole_grad.narrow(1, index * ctx.step, piece.shape[1]).copy_(piece.grad)
        grads = [whole_grad if key == ctx.grad_key else None for key in ctx.keys]
        return (None,) * 9 + tuple(grads)


def sequence_tiled_compute(
    fn: Callable,
    seqlen: int,
    shards: int,
    kwargs_to_shard: dict,
    kwargs_to_pass: dict,
    grad_requiring_tensor_key: str,
    compute_params: Any = None,
    output_unshard_dimension: int = 1,
    output_reduction: Optional[str] = "mean",
) -> torch.Tensor:
    """``fn(**kwargs_to_shard, **kwargs_to_pass)`` computed on tiles of ``ceil(seqlen / shards)`` tokens of the
    tensors in ``kwargs_to_shard`` (cut along dim 1, [batch, tokens, ...]), outputs joined along
    ``output_unshard_dimension`` (0: stacked, e.g. one loss per tile) then reduced by ``output_reduction``
    (``None``, ``"mean"``, ``"sum"``). Backward recomputes each tile and returns the gradient of
    ``kwargs_to_shard[grad_requiring_tensor_key]`` (and of the parameters ``fn`` uses); nothing but the inputs is kept
    between forward and backward. DeepSpeed's signature; ``compute_params`` is accepted and not needed."""
    return SequenceTiledCompute.apply(
        fn,
        seqlen,
        shards,
        list(kwargs_to_shard),
        list(kwargs_to_pass),
        grad_requiring_tensor_key,
        compute_params,
        output_unshard_dimension,
        output_reduction,
        *kwargs_to_shard.values(),
        *kwargs_to_pass.values(),
    )


def _sequence_tiles(named: dict, sharded: int, step: int, seqlen: int) -> list[dict]:
    """Each tile's keyword arguments: the first ``sharded`` entries cut to ``step`` tokens along dim 1, the rest
    passed whole."""
    keys = list(named)
    return [
        {k: named[k][:, start : start + step] if i < sharded else named[k] for i, k in enumerate(keys)}
        for start in range(0, max(seqlen, 1), step)
    ]


def _check_tiles(who: str, tiles: Any) -> None:
    if isinstance(tiles, bool) or not isinstance(tiles, int) or tiles < 1:
        raise ValueError(f"{who}: tiles must be an integer >= 1, got {tiles!r}")


class TiledMLP:
    """``fn(module, x)`` on ``x`` in ``tiles`` pieces along the sequence (dim -2), keeping only ``x`` for backward
    (DeepSpeed's ``TiledMLP``: ``TiledMLP.apply(fn, module, x, tiles, compute_params)``; ``compute_params`` is
    accepted and not needed). ``fn`` must act on each token alone. A :class:`SequenceTiledCompute` over the tokens."""

    @staticmethod
    def apply(fn: Callable, module: Any, x: torch.Tensor, tiles: int, compute_params=None) -> torch.Tensor:
        _check_tiles("TiledMLP", tiles)
        rows = x.reshape(-1, *x.shape[-2:])  # [batch..., tokens, hidden] -> [rows, tokens, hidden]
        out = sequence_tiled_compute(
            lambda x: fn(module, x), rows.shape[1], tiles, {"x": rows}, {}, "x", output_reduction=None
        )
        return out.reshape(*x.shape[:-1], out.shape[-1])


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
        _check_tiles("TiledFusedLogitsLoss", tiles)
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
