"""The loss of a sample whose tokens are spread over a sequence-parallel group, and why its gradient comes out
exact.

Each rank computes the mean loss of its own tokens, ``l_r`` over ``n_r`` counted tokens (labels other than -100).
The sample's loss is the token-weighted mean ``L = sum_r n_r l_r / sum_r n_r``: a rank whose tokens are all -100
(an SFT prompt longer than one piece) has ``n_r = 0`` and a NaN mean, and contributes zero, not NaN.

Every rank computes ``L`` from the gathered ``l_r`` and backpropagates it. The gather's backward sums over the
ranks the gradient each computed for slot r, so rank r's ``l_r`` receives ``P x n_r / N``: P times its share. The
engine averages gradients over all data x sequence ranks, dividing by P x D, which takes the P back out: the
result is the gradient of the mean over the D data-parallel samples of their token-weighted losses, exactly what
one process computes on whole sequences. Averaging over the D data-parallel ranks only (a stage-0 rule that
forgets the sequence ranks), or weighting a non-differentiable gather, is P times off. This is the recipe of the
HF Trainer and of DeepSpeed's ALST examples (``torch.distributed.nn.functional.all_gather``);
:func:`token_weighted_loss` is the same over zeroshard's counted collectives.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import comm
from ..comm.autograd import gather_in_group
from .data import IGNORE_INDEX


def token_weighted_loss(loss: torch.Tensor, shift_labels: torch.Tensor, group: Any) -> torch.Tensor:
    """The sample's loss over ``group`` (a zeroshard group, or the torch ``ProcessGroup`` DeepSpeed's
    ``mpu.get_sequence_parallel_group()`` returns) from this rank's mean ``loss`` over its tokens and its
    ``shift_labels`` (see the module docstring); every rank gets the same value, and backpropagating it on every
    rank gives exact gradients under the engine's average over data x sequence ranks."""
    group = comm.as_group(group, "sequence")
    if loss.dim() != 0:
        raise ValueError(f"token_weighted_loss: loss must be this rank's scalar mean, got shape {list(loss.shape)}")
    counted = (shift_labels != IGNORE_INDEX).sum().to(loss.dtype)
    losses = gather_in_group(loss, group)
    tokens = gather_in_group(counted.detach(), group)
    safe = torch.where(tokens > 0, losses, torch.zeros_like(losses))
    return (safe * tokens).sum() / tokens.sum().clamp(min=1)


__all__ = ["token_weighted_loss"]
