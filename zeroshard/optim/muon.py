"""Muon for the hidden weight matrices, AdamW for everything else (DeepSpeed's ``"type": "Muon"``).

Muon keeps a momentum buffer per matrix (elementwise: ``buf = lerp(buf, g, 1 - momentum)``, the Nesterov update
``u = lerp(g, buf, momentum)``), orthogonalizes ``u`` with the Newton-Schulz iteration (the quintic of
``torch.optim.Muon``, in bf16: ``ns_method: "standard"``; or its Gram form in fp16, DeepSpeed's default ``"gram"``)
and steps ``p *= 1 - lr * wd; p -= lr * sqrt(max(1, rows / cols)) * NS(u)``. Everything but Newton-Schulz is
elementwise; Newton-Schulz needs the whole matrix.

Under ZeRO stages 1-3 each rank holds a contiguous shard of a flat group, and a matrix may straddle shards; under
tensor (or expert) parallelism the matrix is itself cut over the ranks of that axis. Muon declares that it needs
whole matrices (``zero_needs``) and reads the shards' :class:`~zeroshard.optim.contract.ShardLayout`: it updates
the momentum on its shard, has the layout make the Nesterov update ``u`` of each Muon flat group whole (one
all-gather over the shard group, (P-1)/P x 4 bytes x Muon parameters per rank and step; under tensor parallelism
one more over the tensor group, (T-1) x 4 bytes x the flat group), runs Newton-Schulz on every matrix it holds a
piece of, and steps its own piece. No rank needs another's momentum; the parameters' all-gather is unchanged.

``torch.optim.Muon`` given to ``zeroshard.initialize`` is stepped by this class over the same parameter groups
(:meth:`MuonWithAuxAdam.adopting`): its ``nesterov``, ``ns_coefficients``, ``ns_steps``, ``eps`` and
``adjust_lr_fn`` are honoured.

Which parameters are Muon's (DeepSpeed's rule, :func:`muon_param_groups`): those with two or more dimensions whose
name holds neither ``embed`` nor ``lm_head``; the rest (embeddings, the head, norms, biases) are AdamW's. Settings:
``lr``, ``momentum``, ``weight_decay``, ``ns_method`` for the Muon half (``muon_lr`` overrides ``lr``); ``lr``,
``betas``, ``eps``, ``weight_decay`` for the AdamW half (``adam_lr`` overrides ``lr``).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional

import torch
from torch.optim import Optimizer

from .contract import LayoutAware, Needs, ShardLayout

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7
MUON_KEYS = ("lr", "momentum", "weight_decay", "ns_method")
GRAM_RESTART = 2  # the Gram iteration re-forms X and its Gram matrix at this step (half-precision stability)
ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")


def newton_schulz(
    update: torch.Tensor, steps: int = NS_STEPS, eps: float = NS_EPS, coefficients=NS_COEFFICIENTS
) -> torch.Tensor:
    """The orthogonalized direction of a 2-D ``update``: the quintic Newton-Schulz iteration in bf16, on the wide
    orientation (``torch.optim.Muon``'s and Keller Jordan's)."""
    a, b, c = coefficients
    x = update.bfloat16()
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def gram_newton_schulz(
    update: torch.Tensor,
    steps: int = NS_STEPS,
    eps: float = NS_EPS,
    coefficients=NS_COEFFICIENTS,
    restart: int = GRAM_RESTART,
) -> torch.Tensor:
    """The same quintic iteration as :func:`newton_schulz`, in DeepSpeed's Gram form (its ``ns_method: "gram"``,
    the default): writing ``X_k = Q_k X_0``, each step is a polynomial in the small Gram matrix ``R = X X^T``
    (rows x rows on the wide orientation) instead of a product with the wide ``X``, so a matrix ``r`` x ``c`` costs
    ``O(r^2 c)`` once plus ``O(r^3)`` per step. ``Q`` and ``R`` advance as ``Z = bR + cR^2``, ``Q <- aQ + ZQ`` (the
    first ``Q`` is ``aI + Z``), ``R <- (aI + Z) R (aI + Z)``; at step ``restart`` X is re-formed (``X <- QX``) and
    ``R`` recomputed, which keeps half precision stable. Runs in fp16 on an accelerator and in fp32 on the CPU
    (where DeepSpeed's CPU accelerator reports no fp16 either), after normalizing in a dtype whose range the input
    fits; a square matrix gains nothing and takes the plain iteration."""
    a, b, c = coefficients
    x = update.float() if update.dtype == torch.float16 else update
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = (x / x.norm().clamp(min=eps)).to(torch.float32 if x.device.type == "cpu" else torch.float16)
    if x.size(0) == x.size(1):
        for _ in range(steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        return x.T if tall else x
    gram, poly = x @ x.T, None
    for step in range(steps):
        if step == restart:
            x = poly @ x
            gram, poly = x @ x.T, None
        z = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        poly = z + a * torch.eye(z.size(0), dtype=z.dtype, device=z.device) if poly is None else a * poly + z @ poly
        if step < steps - 1 and step + 1 != restart:
            half = a * gram + z @ gram
            gram = a * half + z @ half
    x = poly @ x
    return x.T if tall else x


ORTHOGONALIZE = {"standard": newton_schulz, "gram": gram_newton_schulz}


def lr_scale(shape: tuple[int, ...], adjust_lr_fn: Optional[str] = None) -> float:
    """Muon's step-size factor for a ``shape`` matrix: sqrt(max(1, rows / cols)) (``"original"``, the default), or
    0.2 sqrt(max(rows, cols)) (``"match_rms_adamw"``, Moonshot's; torch.optim.Muon's names)."""
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(shape[0], shape[1]))
    return math.sqrt(max(1.0, shape[0] / shape[1]))


def uses_muon(name: str, param: torch.Tensor) -> bool:
    """DeepSpeed's selection rule: a matrix (2 or more dims) outside the embeddings and the LM head."""
    return param.dim() >= 2 and not any(word in name.lower() for word in ("embed", "lm_head"))


def muon_param_groups(
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]], groups: list[dict], settings: dict[str, Any]
) -> list[dict]:
    """Each of ``groups`` split into its Muon and AdamW halves (empty halves dropped), with the config's settings
    (``muon_lr`` / ``adam_lr`` over ``lr``) under the group's own."""
    names = {id(p): n for n, p in named_parameters}
    halves = []
    for use_muon, keys, lr_key in ((True, MUON_KEYS, "muon_lr"), (False, ADAM_KEYS, "adam_lr")):
        defaults = {k: settings[k] for k in keys if k in settings}
        if lr_key in settings:
            defaults["lr"] = settings[lr_key]
        halves.append((use_muon, keys, defaults))
    out = []
    for group in groups:
        own = {k: v for k, v in group.items() if k != "params"}
        for use_muon, keys, defaults in halves:
            params = [p for p in group["params"] if uses_muon(names.get(id(p), ""), p) is use_muon]
            if params:
                out.append({**defaults, **{k: v for k, v in own.items() if k in keys}, "params": params,
                            "use_muon": use_muon})  # fmt: skip
    return out


class MuonWithAuxAdam(LayoutAware, Optimizer):
    """Muon on the groups with ``use_muon`` true, AdamW (torch's) on the others. A parameter of a Muon group is a
    2-D matrix, or a ZeRO master shard that ``layout`` describes (see the module docstring). A Muon group may also
    carry torch.optim.Muon's ``nesterov``, ``ns_coefficients``, ``ns_steps``, ``ns_eps`` and ``adjust_lr_fn``."""

    zero_needs = Needs(whole_matrices=True)

    def __init__(
        self,
        params,
        lr: float = 0.02,
        momentum: float = 0.95,
        weight_decay: float = 0.0,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        ns_method: str = "gram",
        layout: Optional[ShardLayout] = None,
    ):
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, betas=tuple(betas), eps=eps,
                        ns_method=ns_method, use_muon=True)  # fmt: skip
        super().__init__(params, defaults)
        for group in self.param_groups:
            if group["use_muon"] and not 0 <= group["momentum"] < 1:  # buf = lerp(buf, g, 1 - momentum)
                raise ValueError(
                    f"optimizer.params.momentum {group['momentum']!r}: Muon's momentum is a fraction in [0, 1) "
                    "(DeepSpeed's default 0.95)"
                )
            if group["use_muon"] and group["ns_method"] not in ORTHOGONALIZE:
                raise ValueError(
                    f"optimizer.params.ns_method {group['ns_method']!r}: expected one of {sorted(ORTHOGONALIZE)} "
                    "('gram', DeepSpeed's default, or 'standard', torch.optim.Muon's iteration)"
                )
            group["betas"] = tuple(group["betas"])
        self.layout = layout
        self._adam = torch.optim.AdamW([g for g in self.param_groups if not g["use_muon"]] or [{"params": []}])
        self._adam.state = self.state  # one state dict: checkpoints and state_dict see both halves

    @classmethod
    def adopting(cls, muon: torch.optim.Optimizer, layout: Optional[ShardLayout]) -> MuonWithAuxAdam:
        """This class stepping a ``torch.optim.Muon``'s parameter groups (the same dicts: a scheduler bound to
        ``muon`` still sets their learning rates) with its settings: torch's Newton-Schulz (``ns_method``
        ``"standard"``) with the group's coefficients, steps and ``eps``."""
        for group in muon.param_groups:
            group.update(use_muon=True, ns_method="standard", ns_eps=group["eps"])
        return cls(muon.param_groups, layout=layout)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._adam.param_groups = [g for g in self.param_groups if not g["use_muon"]]
        if self._adam.param_groups:
            self._adam.step()
        for group in self.param_groups:
            if group["use_muon"]:
                for p in group["params"]:
                    if p.grad is not None:
                        self._muon_step(p, group)
        return loss

    def _muon_step(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        if not state:
            state["momentum_buffer"] = torch.zeros_like(p)
        buf = state["momentum_buffer"]
        buf.lerp_(p.grad, 1 - group["momentum"])
        update = p.grad.lerp(buf, group["momentum"]) if group.get("nesterov", True) else buf
        p.mul_(1 - group["lr"] * group["weight_decay"])

        def direction(matrix: torch.Tensor) -> torch.Tensor:
            orthogonalize = ORTHOGONALIZE[group["ns_method"]]
            settings = (group.get("ns_steps", NS_STEPS), group.get("ns_eps", NS_EPS))
            return orthogonalize(matrix.reshape(matrix.shape[0], -1), *settings,
                                 tuple(group.get("ns_coefficients", NS_COEFFICIENTS))).view_as(matrix)  # fmt: skip

        def alpha(shape: tuple[int, ...]) -> float:
            return -group["lr"] * lr_scale(shape, group.get("adjust_lr_fn"))

        if p.dim() >= 2:
            p.add_(direction(update), alpha=alpha(p.shape))
            return
        if self.layout is None:
            raise ValueError("Muon got a flat parameter without its ZeRO layout: build it through zeroshard.initialize")
        for matrix in self.layout.matrices(p, update):  # made whole from every rank (on the compute device)
            local = matrix.local(direction(matrix.whole))
            p[matrix.start : matrix.stop].add_(local.to(p.device), alpha=alpha(matrix.whole.shape))


__all__ = ["MuonWithAuxAdam", "gram_newton_schulz", "muon_param_groups", "newton_schulz", "uses_muon"]
