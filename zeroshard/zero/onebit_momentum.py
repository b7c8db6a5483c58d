"""1-bit Adam's momentum exchange over the ZeRO shard layout, the same at every stage (Note [1-bit reduction] in
``docs/design.md``).

After its warm-up, 1-bit Adam (arXiv:2102.02888, DeepSpeed's ``OnebitAdam``) averages the momentum, not the
gradient: every rank holds the last averaged momentum ``m`` whole, forms the momentum its own gradient would give,
``m_i = beta1 * m + (1 - beta1) * g_i``, and the ranks average the ``m_i`` 1-bit compressed with error feedback.
The momentum changes slowly, so its signs say more than a gradient's, and compressing it loses less: issue 31
measured a 1-bit reduce-scatter of gradients 7 points of loss behind this on a short run with an early freeze.

The two phases follow the flat group's shard layout (at stage 0, one shard: the padded flat cut in group-size
chunks for the exchange only):

- reduce-scatter: each rank sends chunk j of ``m_i`` (plus its worker error for that chunk) 1-bit compressed to
  chunk j's owner, which sums them with its own exact chunk;
- all-gather: the owner divides by the group size, adds its server error and sends the chunk 1-bit compressed to
  every rank, itself included. The gathered messages are ``m`` for the next step: one bit per element and one
  scale per 256, the only copy of the whole momentum a rank keeps between steps.

The optimizer of each shard then takes, on its own range, ``g = (m_new - beta1 * m_old) / (1 - beta1)``: the
gradient whose momentum rule leads from the old averaged momentum to the new one. 1-bit Adam's step, its homes
(device, host, NVMe), the unseen-element mask and checkpoints are therefore those of exact training; the
exchange needs each rank's whole gradient, which the reducer keeps unreduced in the compressed phase.

Right after the warm-up, ``m`` is the owners' ``exp_avg``, gathered exactly once. The errors and messages are per
rank and layout: a checkpoint saves each rank's (:meth:`OneBitMomentum.state_tensors`), and a load at the same
layout (world size, shard groups, flat groups) restores them, so a resume in the compressed phase continues bit for
bit; at another layout they do not fit, and the load starts the exchange afresh from the loaded ``exp_avg`` with
zero errors (what DeepSpeed does on every load).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .. import comm
from ..comm.compression import ONE_BIT
from .flat_group import FlatGroup


@dataclass
class _Exchange:
    """One flat group's compression state: the worker error (the chunks this rank sends), the server error (the
    chunk it owns) and the last gathered momentum, as 1-bit messages (None: gather the owners' ``exp_avg``)."""

    worker_error: torch.Tensor
    server_error: torch.Tensor
    momentum: Optional[torch.Tensor] = None

    def nbytes(self) -> int:
        held = [self.worker_error, self.server_error] + ([self.momentum] if self.momentum is not None else [])
        return sum(t.numel() * t.element_size() for t in held)


class OneBitMomentum:
    """Exchanges 1-bit Adam's momentum for every flat group (see the module docstring); owns the compression state."""

    def __init__(self, flats: list[FlatGroup]):
        self.flats = flats
        self._state: dict[int, _Exchange] = {}

    def chunk_numel(self, index: int) -> int:
        flat = self.flats[index]
        return -(-flat.layout.padded_numel // flat.shard_group.size)

    def exchange(
        self, index: int, local_grad: torch.Tensor, coef: float, beta1: float, exp_avg: Optional[torch.Tensor]
    ) -> torch.Tensor:
        """``local_grad``: this rank's whole (padded) gradient of flat group ``index``, unreduced; ``coef``: its
        unscale and clip factor; ``exp_avg``: the owner's momentum shard as the optimizer holds it (read only
        right after the warm-up or a load). Returns this rank's shard range of ``local_grad``, overwritten with
        the gradient that takes the optimizer's momentum to the averaged one."""
        flat, group = self.flats[index], self.flats[index].shard_group
        n, chunk = group.size, self.chunk_numel(index)
        lo, hi = flat.layout.shard_range(flat.shard_rank)
        if n == 1:  # one rank: its momentum is the average, exactly
            return local_grad[lo:hi].mul_(coef)
        state = self._state.get(index)
        if state is None:
            state = self._state[index] = _Exchange(
                torch.zeros((n - 1) * chunk, dtype=torch.float32, device=flat.device),
                torch.zeros(chunk, dtype=torch.float32, device=flat.device),
            )
        momentum = self._last_momentum(index, state, exp_avg)
        old = momentum[lo:hi].clone()
        padded = flat.layout.padded_numel
        momentum[:padded].mul_(beta1).add_(local_grad.to(momentum.device, torch.float32), alpha=(1 - beta1) * coef)
        comm.compressed_reduce_scatter(momentum, state.worker_error, group)
        momentum.view(n, chunk)[group.rank].div_(n)
        if state.momentum is None:
            state.momentum = torch.empty(n, ONE_BIT.message_nbytes(chunk), dtype=torch.uint8, device=flat.device)
        comm.compressed_all_gather(momentum, state.server_error, group, messages=state.momentum)
        shard = local_grad[lo:hi]
        shard.copy_(momentum[lo:hi].sub_(old, alpha=beta1).div_(1 - beta1))
        return shard

    def _last_momentum(self, index: int, state: _Exchange, exp_avg: Optional[torch.Tensor]) -> torch.Tensor:
        """The last averaged momentum, whole, in a fresh fp32 buffer of group-size chunks (zero-padded)."""
        flat, group = self.flats[index], self.flats[index].shard_group
        n, chunk = group.size, self.chunk_numel(index)
        momentum = torch.zeros(n * chunk, dtype=torch.float32, device=flat.device)
        if state.momentum is not None:
            for j, piece in enumerate(momentum.view(n, chunk)):
                ONE_BIT.decompress(state.momentum[j], chunk, piece)
            momentum[flat.layout.padded_numel :].zero_()  # stage 0's chunks pad the flat: nothing to carry there
        elif exp_avg is not None:
            momentum[: flat.layout.padded_numel].copy_(flat.whole_of(exp_avg.to(flat.device, torch.float32)))
        return momentum

    def last_momentum(self, index: int) -> torch.Tensor:
        """The last averaged momentum of flat group ``index`` as every rank holds it, decompressed (whole, padded)."""
        state = self._state[index]
        return self._last_momentum(index, state, None)[: self.flats[index].layout.padded_numel]

    def needs_exp_avg(self, index: int) -> bool:
        """Whether the next exchange of flat group ``index`` starts from the optimizer's momentum."""
        state = self._state.get(index)
        return state is None or state.momentum is None

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's compression state, for a checkpoint: per flat group its two errors and the gathered
        momentum's 1-bit messages."""
        out = {}
        for index, state in sorted(self._state.items()):
            out[f"fg{index}.worker_error"] = state.worker_error
            out[f"fg{index}.server_error"] = state.server_error
            if state.momentum is not None:
                out[f"fg{index}.momentum"] = state.momentum
        return out

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> bool:
        """Restore what :meth:`state_tensors` saved when every tensor fits this layout exactly; otherwise keep the
        exchange reset. Returns whether it restored."""
        restored: dict[int, _Exchange] = {}
        for index, flat in enumerate(self.flats):
            n, chunk = flat.shard_group.size, self.chunk_numel(index)
            worker, server = tensors.get(f"fg{index}.worker_error"), tensors.get(f"fg{index}.server_error")
            momentum = tensors.get(f"fg{index}.momentum")
            if worker is None and server is None and momentum is None:
                continue
            fits = (
                worker is not None
                and server is not None
                and n > 1
                and worker.shape == ((n - 1) * chunk,)
                and server.shape == (chunk,)
                and (momentum is None or momentum.shape == (n, ONE_BIT.message_nbytes(chunk)))
                and bool(torch.isfinite(worker).all() and torch.isfinite(server).all())
            )
            if not fits:
                return False
            restored[index] = _Exchange(
                worker.to(flat.device, torch.float32),
                server.to(flat.device, torch.float32),
                momentum.to(flat.device, torch.uint8) if momentum is not None else None,
            )
        if len(tensors) != sum(2 + (s.momentum is not None) for s in restored.values()):
            return False  # names of flat groups this layout does not have
        self._state = restored
        return True

    def reset(self) -> None:
        """Forget the errors and the gathered momentum (after a load: they are per rank and world size)."""
        self._state.clear()

    def nbytes(self) -> int:
        return sum(state.nbytes() for state in self._state.values())
