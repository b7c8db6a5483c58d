"""The 1-bit optimizers of DeepSpeed by name: 1-bit Adam, 0/1 Adam, 1-bit LAMB (DeepSpeed's parameters and
defaults). Each warms up exactly, then communicates 1-bit compressed (:mod:`zeroshard.comm.compressed`).

Who communicates (Note [1-bit reduction] in ``docs/design.md``): after the warm-up every rank keeps its own
gradients, unreduced, and what DeepSpeed averages is averaged 1-bit compressed with error feedback:

- 1-bit Adam, at ZeRO stages 0-3: the momentum, exchanged by the ZeRO layer over the shard layout
  (:mod:`zeroshard.zero.onebit_momentum`); the optimizer is handed the gradient that takes its momentum to the
  averaged one, and steps its shard with the variance frozen, communicating nothing itself;
- 0/1 Adam and 1-bit LAMB, at stage 0 only: the optimizer averages itself (0/1 Adam the gradient or the
  accumulated update, 1-bit LAMB the scaled momentum) through the ``OneBitAllReduce`` of the ZeRO layout they
  are given (``ShardLayout.compressed``).

The ZeRO layer asks ``needs_averaged_gradients()`` before every backward: True during warm-up (exact reduction).
The compression errors are not optimizer state: they are per rank and world size, so a checkpoint does not keep
them (DeepSpeed resets them on load too).
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch
from torch.optim import Optimizer

from ..comm.backend import get_rank
from . import hyperparams
from .contract import LayoutAware, Needs, ShardLayout

COMM_BACKENDS = ("nccl", "mpi", "hccl", "compressed")


class OneBitOptimizer(LayoutAware, Optimizer):
    """What the 1-bit optimizers share: the warm-up question and the layout's compressed all-reduce."""

    # how the ZeRO layer exchanges gradients for it after the warm-up (zeroshard.zero.exchange): 1-bit Adam's
    # momentum averaged over the shard layout, so that it runs at stages 1-3 too ("momentum"); the others average
    # themselves, whole tensors at stage 0 ("optimizer_averaged")
    zero_needs = Needs(gradient_exchange="optimizer_averaged")

    def __init__(
        self,
        params,
        defaults: dict,
        cuda_aware: bool,
        comm_backend_name: str,
        amsgrad: bool,
        schedule: dict,
        layout: Optional[ShardLayout] = None,
    ):
        """``defaults`` (lr, betas, eps, weight_decay) and the subclass's ``schedule`` numbers are checked here
        (:mod:`zeroshard.optim.hyperparams`), for optimizers built by name and by a script alike; the checked
        schedule is ``self.schedule``."""
        name = f"{type(self).__name__}: "
        defaults = hyperparams.check(name, defaults)
        self.schedule = hyperparams.check(name, schedule)
        hyperparams.check(name, {"cuda_aware": cuda_aware, "amsgrad": amsgrad})
        if amsgrad:
            raise ValueError(f"{type(self).__name__} does not support amsgrad (nor does DeepSpeed's)")
        if comm_backend_name not in COMM_BACKENDS:
            raise ValueError(f"optimizer.params.comm_backend_name must be one of {list(COMM_BACKENDS)}")
        if (cuda_aware or comm_backend_name != "nccl") and get_rank() == 0:  # said once, not once per rank
            warnings.warn(
                f"{type(self).__name__}: cuda_aware={cuda_aware} and comm_backend_name={comm_backend_name!r} choose "
                "among DeepSpeed's MPI/NCCL 1-bit backends; zeroshard sends the compressed messages through the "
                "process group's own backend (NCCL or Gloo), so they have no effect",
                stacklevel=3,
            )
        super().__init__(params, defaults)
        self.layout = layout

    @property
    def all_reduce(self):
        """Stage 0: the compressed all-reduce this optimizer averages with (the layout's; it owns the compression
        errors). None on one rank, and for 1-bit Adam, whose momentum the ZeRO layer exchanges."""
        return self.layout.compressed if self.layout is not None else None

    def needs_averaged_gradients(self) -> bool:
        """Whether the next step takes exactly averaged gradients (else this rank's own, or 1-bit reduced ones)."""
        raise NotImplementedError

    def reset_compression(self) -> None:
        """Forget the compression errors and partial local accumulations (after a checkpoint load)."""
        if self.all_reduce is not None:
            self.all_reduce.reset()

    def compression_bytes(self) -> int:
        """Bytes this optimizer holds for compression: the errors (stage 0) and, 0/1 Adam, local updates."""
        return self.all_reduce.nbytes() if self.all_reduce is not None else 0

    def _first_state(self) -> dict:
        """The state of the first parameter stepped so far (every parameter shares the step count and schedules)."""
        return next((self.state[p] for g in self.param_groups for p in g["params"] if p in self.state), {})

    def steps_taken(self) -> int:
        return self._first_state().get("step", 0)

    def _stepped(self):
        """(group, parameter, state) for each parameter with a gradient, its Adam state created and its step counted."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = _adam_state(self.state[p], p)
                    state["step"] += 1
                    yield group, p, state

    def _average(self, tensor: torch.Tensor, key: object) -> None:
        if self.all_reduce is not None:
            self.all_reduce(tensor, key)


class OneBitAdam(OneBitOptimizer):
    """1-bit Adam: Adam (no bias correction, as DeepSpeed's) for ``freeze_step`` steps, then the variance frozen
    and the momentum averaged 1-bit compressed with error feedback (by the ZeRO layer, which hands this optimizer
    the gradient that leads its momentum to the averaged one)."""

    zero_needs = Needs(gradient_exchange="momentum")

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        freeze_step: int = 100000,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
    ):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults, cuda_aware, comm_backend_name, amsgrad, {"freeze_step": freeze_step})
        self.freeze_step = self.schedule["freeze_step"]

    def needs_averaged_gradients(self) -> bool:
        return self.steps_taken() < self.freeze_step

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group, p, state in self._stepped():
            beta1, beta2 = group["betas"]
            m, v = state["exp_avg"], state["exp_avg_sq"]
            m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
            if state["step"] <= self.freeze_step:
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            else:  # under an engine the momentum is now the 1-bit averaged one (Note [1-bit reduction])
                _mask_unseen(m, v)
            _apply(p, m, v, group)
        return loss


class ZeroOneAdam(OneBitOptimizer):
    """0/1 Adam (arXiv:2202.06009): the variance is updated only on steps ``var_interval`` apart (the interval
    doubles every ``var_update_scaler`` updates), on which gradients are averaged exactly; on the others the
    gradient is averaged 1-bit compressed. After ``var_freeze_step`` the ranks take local steps and synchronise
    their accumulated update, 1-bit compressed, every ``local_step_interval`` steps (doubling every
    ``local_step_scaler`` steps, up to ``local_step_clipper``)."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        var_freeze_step: int = 100000,
        var_update_scaler: int = 16,
        local_step_scaler: int = 32678,
        local_step_clipper: int = 16,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
        layout: Optional[ShardLayout] = None,
    ):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        schedule = dict(
            var_freeze_step=var_freeze_step,
            var_update_scaler=var_update_scaler,
            local_step_scaler=local_step_scaler,
            local_step_clipper=local_step_clipper,
        )
        super().__init__(params, defaults, cuda_aware, comm_backend_name, amsgrad, schedule, layout)
        self.var_freeze_step = self.schedule["var_freeze_step"]
        self.var_update_scaler = self.schedule["var_update_scaler"]
        self.local_step_scaler = self.schedule["local_step_scaler"]
        self.local_step_clipper = self.schedule["local_step_clipper"]
        self._local: dict[torch.Tensor, tuple[torch.Tensor, list[float]]] = {}  # summed local updates and lrs

    def needs_averaged_gradients(self) -> bool:
        following = self.steps_taken() + 1
        return following <= self.var_freeze_step and following % self._first_state().get("var_interval", 1) == 0

    def reset_compression(self) -> None:
        super().reset_compression()
        self._local.clear()

    def compression_bytes(self) -> int:
        return super().compression_bytes() + sum(t.numel() * t.element_size() for t, _ in self._local.values())

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group, p, state in self._stepped():
            beta1, beta2 = group["betas"]
            for kind in ("var", "local"):
                state.setdefault(f"{kind}_interval", 1)
                state.setdefault(f"{kind}_counter", 0)
            step, m, v = state["step"], state["exp_avg"], state["exp_avg_sq"]
            if step > self.var_freeze_step:
                m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                self._local_step(group, p, state)
                continue
            if step % state["var_interval"] == 0:  # the gradient was averaged exactly
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
            else:
                grad = p.grad.clone()
                self._average(grad, (p, "grad"))
                m.mul_(beta1).add_(grad, alpha=1 - beta1)
                _mask_unseen(m, v)
            _apply(p, m, v, group)
            _advance(state, "var", step % state["var_interval"] == 0, self.var_update_scaler, None)
        return loss

    def _local_step(self, group: dict, p: torch.Tensor, state: dict) -> None:
        """Step locally and accumulate the update; every ``local_interval`` steps replace the ranks' local
        updates by their 1-bit average (taken on the update times the frozen preconditioner) and the momentum by
        the one that average implies."""
        summed, lrs = self._local.setdefault(p, (torch.zeros_like(p), []))
        before = p.detach().clone()
        _apply(p, state["exp_avg"], state["exp_avg_sq"], group)
        summed.add_(p.detach() - before)  # -lr * update
        lrs.append(group["lr"])
        if state["step"] % state["local_interval"] == 0:
            denom = state["exp_avg_sq"].sqrt().add_(group["eps"])
            p.sub_(summed)
            summed.mul_(denom)
            self._average(summed, (p, "momentum"))
            _mask_unseen(summed, state["exp_avg_sq"])
            state["exp_avg"].copy_(summed).div_(-sum(lrs))
            p.addcdiv_(summed, denom)
            del self._local[p]
        _advance(state, "local", True, self.local_step_scaler, self.local_step_clipper)


def _advance(state: dict, kind: str, counted: bool, scaler: int, clipper: Optional[int]) -> None:
    """0/1 Adam's exponential schedules: every ``scaler`` counted steps the interval doubles (up to ``clipper``)."""
    if not counted:
        return
    state[f"{kind}_counter"] += 1
    if state[f"{kind}_counter"] == scaler:
        state[f"{kind}_counter"] = 0
        doubled = state[f"{kind}_interval"] * 2
        state[f"{kind}_interval"] = doubled if clipper is None else min(clipper, doubled)


class OneBitLamb(OneBitOptimizer):
    """1-bit LAMB (arXiv:2104.06069): LAMB for ``freeze_step`` steps, tracking a moving average of each
    parameter's trust ratio (``coeff_beta``); then the variance frozen, the momentum averaged 1-bit compressed
    (each parameter's scaled to a common magnitude first), and the trust ratio the frozen one times a factor from
    a fresh variance estimate, clamped to [``factor_min``, ``factor_max``] and to ``factor_threshold`` change per
    step. A flat tensor holds many parameters: the ZeRO layout says which ranges are which."""

    zero_needs = Needs(parameter_norms=True, gradient_exchange="optimizer_averaged")

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        freeze_step: int = 100000,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
        coeff_beta: float = 0.9,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
        layout: Optional[ShardLayout] = None,
    ):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        schedule = dict(
            freeze_step=freeze_step,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
            coeff_beta=coeff_beta,
            factor_max=factor_max,
            factor_min=factor_min,
            factor_threshold=factor_threshold,
        )
        super().__init__(params, defaults, cuda_aware, comm_backend_name, amsgrad, schedule, layout)
        self.freeze_step = self.schedule["freeze_step"]
        self.max_coeff, self.min_coeff = self.schedule["max_coeff"], self.schedule["min_coeff"]
        self.coeff_beta = self.schedule["coeff_beta"]
        self.factor_max, self.factor_min = self.schedule["factor_max"], self.schedule["factor_min"]
        self.factor_threshold = self.schedule["factor_threshold"]

    def needs_averaged_gradients(self) -> bool:
        return self.steps_taken() < self.freeze_step

    def _segments(self, p: torch.Tensor) -> list[tuple[int, int, int]]:
        if self.layout is None:
            return [(0, 0, p.numel())]
        return self.layout.segments(p)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        live = []
        for group, p, state in self._stepped():
            if "coeff_freeze" not in state:
                count = len(self._segments(p))
                state.update(coeff_freeze=[0.0] * count, last_factor=[1.0] * count)
                state["exp_avg_sq_fresh"] = torch.zeros_like(p)
            live.append((group, p))
        if live and self.state[live[0][1]]["step"] <= self.freeze_step:
            for group, p in live:
                self._warmup_step(group, p, self.state[p])
        else:
            self._compressed_step(live)
        return loss

    def _warmup_step(self, group: dict, p: torch.Tensor, state: dict) -> None:
        beta1, beta2 = group["betas"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
        if state["step"] == self.freeze_step:
            state["exp_avg_sq_fresh"].copy_(v)
        update = m / v.sqrt().add_(group["eps"])
        if group["weight_decay"]:
            update.add_(p, alpha=group["weight_decay"])
        flat_p, flat_u = p.view(-1), update.view(-1)
        for k, (_, start, numel) in enumerate(self._segments(p)):
            piece = slice(start, start + numel)
            w_norm, u_norm = flat_p[piece].norm().item(), flat_u[piece].norm().item()
            coeff = 1.0
            if w_norm and u_norm:
                coeff = min(max(w_norm / u_norm, self.min_coeff), self.max_coeff)
            if coeff != 1.0:
                frozen = state["coeff_freeze"]
                frozen[k] = self.coeff_beta * frozen[k] + (1 - self.coeff_beta) * coeff
            flat_p[piece].add_(flat_u[piece], alpha=-group["lr"] * coeff)

    def _compressed_step(self, live: list[tuple[dict, torch.Tensor]]) -> None:
        previous = {p: self.state[p]["exp_avg"].clone() for _, p in live}
        if "scaling" not in self.state[live[0][1]]:
            self._freeze_scaling(live)
        for group, p in live:  # this rank's momentum, scaled, then averaged
            state = self.state[p]
            beta1 = group["betas"][0]
            state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
            state["exp_avg"].mul_(self._per_element(p, state["scaling"]))
            self._average(state["exp_avg"], p)
            state["exp_avg"].div_(self._per_element(p, state["scaling"]))
            _mask_unseen(state["exp_avg"], state["exp_avg_sq"])
        for group, p in live:
            self._frozen_lamb_update(group, p, self.state[p], previous[p])

    def _freeze_scaling(self, live: list[tuple[dict, torch.Tensor]]) -> None:
        """At the first compressed step: scale each parameter's momentum to the mean magnitude of all, so one
        compression scale fits them (DeepSpeed's ``scaling_coeff``)."""
        magnitudes = {
            p: [self.state[p]["exp_avg"].view(-1)[s : s + n].norm().item() / n**0.5 for _, s, n in self._segments(p)]
            for _, p in live
        }
        every = [value for values in magnitudes.values() for value in values]
        common = sum(every) / len(every)
        for _, p in live:
            self.state[p]["scaling"] = [common / value if value else 1.0 for value in magnitudes[p]]

    def _per_element(self, p: torch.Tensor, values: list[float]) -> torch.Tensor:
        lengths = torch.tensor([n for _, _, n in self._segments(p)], device=p.device)
        return torch.tensor(values, dtype=p.dtype, device=p.device).repeat_interleave(lengths).view_as(p)

    def _frozen_lamb_update(self, group: dict, p: torch.Tensor, state: dict, previous: torch.Tensor) -> None:
        beta1, beta2 = group["betas"]
        eps, decay = group["eps"], group["weight_decay"]
        m, fresh = state["exp_avg"], state["exp_avg_sq_fresh"]
        grad = (m - previous * beta1) / (1 - beta1)  # the averaged gradient the momentum implies
        fresh.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = state["exp_avg_sq"].sqrt().add_(eps)
        prelim = m / denom
        update = prelim + decay * p if decay else prelim
        ratio = denom / fresh.sqrt().add_(eps)
        flat_p, flat_u, flat_prelim, flat_ratio = p.view(-1), update.view(-1), prelim.view(-1), ratio.view(-1)
        for k, (_, start, numel) in enumerate(self._segments(p)):
            piece = slice(start, start + numel)
            factor = flat_ratio[piece].max().item()
            if decay:
                u_norm = flat_u[piece].norm().item()
                share = min(1.0, flat_prelim[piece].norm().item() / u_norm) if u_norm else 1.0
                factor = factor * share + (1.0 - share)
            last = state["last_factor"][k]
            factor = min(max(factor, self.factor_min), self.factor_max)
            factor = min(max(factor, last * (1.0 - self.factor_threshold)), last * (1.0 + self.factor_threshold))
            state["last_factor"][k] = factor
            flat_p[piece].add_(flat_u[piece], alpha=-group["lr"] * state["coeff_freeze"][k] * factor)


def _mask_unseen(m: torch.Tensor, v: torch.Tensor) -> None:
    """Elements whose frozen variance is exactly zero never had a gradient (an unused embedding row, position
    embeddings past the sequence length): their momentum stays zero. 1-bit compression cannot send a zero, and
    ``m / (sqrt(0) + eps)`` would step them by ``scale / eps`` (DeepSpeed asks the user for an ``exp_avg_mask``)."""
    m.masked_fill_(v == 0, 0.0)


def _adam_state(state: dict, p: torch.Tensor) -> dict:
    if not state:
        state["step"] = 0
        state["exp_avg"] = torch.zeros_like(p)
        state["exp_avg_sq"] = torch.zeros_like(p)
    return state


def _apply(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, group: dict) -> None:
    """``p -= lr * (m / (sqrt(v) + eps) + weight_decay * p)``: DeepSpeed's 1-bit update (no bias correction)."""
    if group["weight_decay"]:
        p.mul_(1 - group["lr"] * group["weight_decay"])
    p.addcdiv_(m, v.sqrt().add_(group["eps"]), value=-group["lr"])
