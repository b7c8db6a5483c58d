"""Optimizers by DeepSpeed name, and the check that a client optimizer is safe to shard."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ..ops.adagrad import CPUAdagrad
from ..ops.adam import CPUAdam
from . import hyperparams
from .contract import LayoutAware, ShardLayout, needs_of
from .lamb import Lamb
from .lion import Lion
from .muon import MuonWithAuxAdam
from .onebit import OneBitAdam, OneBitLamb, ZeroOneAdam

# Accepted keys of optimizer.params per DeepSpeed name (lower case, as DeepSpeed matches them).
_ADAM_KEYS = {
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "amsgrad",
    "adam_w_mode",
    "torch_adam",
    "bias_correction",
    "fused",
    "foreach",
    "set_grad_none",
    "capturable",
    "maximize",
}
OPTIMIZER_KEYS: dict[str, set[str]] = {
    "adam": _ADAM_KEYS,
    "adamw": _ADAM_KEYS,
    "sgd": {"lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize", "foreach", "fused"},
    "adagrad": {"lr", "lr_decay", "weight_decay", "eps", "initial_accumulator_value", "foreach", "fused"},
    "lamb": {"lr", "betas", "eps", "weight_decay", "bias_correction", "max_coeff", "min_coeff", "max_grad_norm"},
    "lion": {"lr", "betas", "weight_decay"},
}
_ONEBIT_KEYS = {"lr", "betas", "eps", "weight_decay", "amsgrad", "cuda_aware", "comm_backend_name"}
ONEBIT = {"onebitadam": OneBitAdam, "zerooneadam": ZeroOneAdam, "onebitlamb": OneBitLamb}
OPTIMIZER_KEYS.update(
    onebitadam=_ONEBIT_KEYS | {"freeze_step"},
    zerooneadam=_ONEBIT_KEYS | {"var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper"},
    onebitlamb=_ONEBIT_KEYS
    | {"freeze_step", "max_coeff", "min_coeff", "coeff_beta", "factor_max", "factor_min", "factor_threshold"},
)
OPTIMIZER_KEYS["muon"] = {"lr", "momentum", "weight_decay", "muon_lr", "adam_lr", "ns_method", "betas", "eps"}
NOT_IMPLEMENTED = {"muadam", "muadamw", "musgd", "cpuadam"}

# Optimizers whose update is elementwise, or that declare what else they read (contract.Needs): exact on shards.
SHARD_SAFE = (
    torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad, Lion, Lamb, OneBitAdam, MuonWithAuxAdam,
    *((torch.optim.Muon,) if hasattr(torch.optim, "Muon") else ()),
)  # fmt: skip
_TORCH_MUON_CLASSES = (torch.optim.Muon,) if hasattr(torch.optim, "Muon") else ()


def _kernel_flags(cls, params: dict[str, Any]) -> dict[str, Any]:
    """Prefer torch's fused kernel, else foreach, unless the user chose."""
    if "fused" in params or "foreach" in params:
        return {}
    accepted = inspect.signature(cls).parameters
    if "fused" in accepted:
        return {"fused": True}
    return {"foreach": True} if "foreach" in accepted else {}


Builder = Callable[[dict[str, Any], list[dict], "BuildContext"], torch.optim.Optimizer]


@dataclass(frozen=True)
class BuildContext:
    """What a builder may read besides its ``optimizer.params``: the name as written, the ZeRO stage, whether an
    unverified optimizer is allowed, and the shards' layout (None in one process, or where the home cuts shards)."""

    name: str
    zero_stage: int
    allow_untested: bool
    layout: Optional[ShardLayout]


def _construct(cls, params: dict[str, Any], groups: list[dict], context: BuildContext) -> torch.optim.Optimizer:
    """``cls`` over ``groups``: the layout passed at construction when the class reads one, torch's fused (or
    foreach) kernel preferred unless the config chose, betas as a tuple."""
    if "betas" in params:
        params["betas"] = tuple(params["betas"])
    if needs_of(cls).needs_layout:
        params["layout"] = context.layout
    try:
        return cls(groups, **params, **_kernel_flags(cls, params))
    except TypeError as err:
        raise ValueError(f"optimizer '{context.name}' rejected optimizer.params {params}: {err}") from None


def _adam(params: dict[str, Any], groups: list[dict], context: BuildContext) -> torch.optim.Optimizer:
    adam_w_mode = params.pop("adam_w_mode", True)
    if context.name.lower() == "adamw" and adam_w_mode is False:
        raise ValueError("optimizer 'AdamW' with optimizer.params.adam_w_mode false is contradictory; use 'Adam'")
    if params.pop("bias_correction", True) is not True:
        raise NotImplementedError("optimizer.params.bias_correction false is not supported for Adam")
    for ignored in ("torch_adam", "set_grad_none"):
        params.pop(ignored, None)
    params.setdefault("weight_decay", 0.0)  # DeepSpeed's FusedAdam and CPU Adam default (torch's AdamW: 0.01)
    return _construct(torch.optim.AdamW if adam_w_mode else torch.optim.Adam, params, groups, context)


def _lamb(params: dict[str, Any], groups: list[dict], context: BuildContext) -> torch.optim.Optimizer:
    params.pop("max_grad_norm", None)  # DeepSpeed's FusedLamb ignores it too: clipping is gradient_clipping
    return _construct(Lamb, params, groups, context)


def _muon(params: dict[str, Any], groups: list[dict], context: BuildContext) -> torch.optim.Optimizer:
    for split in ("muon_lr", "adam_lr"):  # applied per half by muon_param_groups
        params.pop(split, None)
    params.setdefault("ns_method", "gram")  # DeepSpeed's default: Gram Newton-Schulz in fp16
    return _construct(MuonWithAuxAdam, params, groups, context)


def _plain(cls) -> Builder:
    def build(params: dict[str, Any], groups: list[dict], context: BuildContext) -> torch.optim.Optimizer:
        return _construct(cls, params, groups, context)

    return build


# DeepSpeed's optimizer names (lower case, as DeepSpeed matches them) -> builder; any other name is looked up in
# torch.optim (:func:`_torch_optimizer`)
BUILDERS: dict[str, Builder] = {
    "adam": _adam,
    "adamw": _adam,
    "lamb": _lamb,
    "lion": _plain(Lion),
    "sgd": _plain(torch.optim.SGD),
    "adagrad": _plain(torch.optim.Adagrad),
    "muon": _muon,
    **{name: _plain(cls) for name, cls in ONEBIT.items()},
}


def _torch_optimizer(params: dict[str, Any], groups: list[dict], context: BuildContext) -> torch.optim.Optimizer:
    cls = getattr(torch.optim, context.name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ValueError(
            f"config key 'optimizer.type' = {context.name!r}: no such optimizer in zeroshard or torch.optim"
        )
    if context.zero_stage > 0 and not context.allow_untested:
        raise ValueError(
            f"optimizer.type '{context.name}' is not verified with ZeRO sharding (its update may not be "
            'elementwise); set "zero_allow_untested_optimizer": true to use it anyway'
        )
    return _construct(cls, params, groups, context)


def build_optimizer(
    name: str,
    params: dict[str, Any],
    param_groups: list[dict],
    *,
    zero_stage: int,
    allow_untested: bool,
    layout: Optional[ShardLayout] = None,
) -> torch.optim.Optimizer:
    """The optimizer ``optimizer.type`` names over ``param_groups``, its ``optimizer.params`` checked against the
    keys DeepSpeed accepts for it; ``layout`` (the ZeRO shards') reaches the optimizers that read one."""
    key = name.lower()
    if key in NOT_IMPLEMENTED:
        raise NotImplementedError(
            f"optimizer.type '{name}' is not implemented in zeroshard; use Adam, AdamW, Lamb or Lion"
        )
    unknown = sorted(set(params) - OPTIMIZER_KEYS[key]) if key in OPTIMIZER_KEYS else []
    if unknown:
        raise ValueError(
            f"unknown config key 'optimizer.params.{unknown[0]}' for optimizer '{name}'; "
            f"accepted: {sorted(OPTIMIZER_KEYS[key])}"
        )
    checked = hyperparams.check("optimizer.params.", dict(params))
    context = BuildContext(name, zero_stage, allow_untested, layout)
    return BUILDERS.get(key, _torch_optimizer)(checked, param_groups, context)


def bind_layout(optimizer: torch.optim.Optimizer, layout: Optional[ShardLayout]) -> torch.optim.Optimizer:
    """The optimizer ZeRO steps over the shards ``layout`` describes, from one a client built: ``optimizer`` itself,
    bound to the layout when it reads one (:class:`~.contract.LayoutAware`); torch's Muon, which steps whole 2-D
    tensors only, as zeroshard's Muon over the same parameter groups (:meth:`MuonWithAuxAdam.adopting`)."""
    if isinstance(optimizer, _TORCH_MUON_CLASSES):
        return MuonWithAuxAdam.adopting(optimizer, layout)
    if isinstance(optimizer, LayoutAware):
        optimizer.bind_layout(layout)
    return optimizer


def check_client_optimizer(
    optimizer: torch.optim.Optimizer, zero_stage: int, allow_untested: bool, force_cpu_optimizer: bool = False
) -> None:
    """``force_cpu_optimizer`` is DeepSpeed's ``zero_force_ds_cpu_optimizer`` with ``offload_optimizer``: a client
    optimizer must then be one of the CPU optimizers (Adam, Adagrad, Lion: a generic one steps far slower)."""
    if zero_stage > 0 and not isinstance(optimizer, SHARD_SAFE) and not allow_untested:
        raise ValueError(
            f"client optimizer {type(optimizer).__name__} is not verified with ZeRO sharding; "
            'set "zero_allow_untested_optimizer": true to use it anyway'
        )
    if force_cpu_optimizer and not isinstance(optimizer, (CPUAdam, CPUAdagrad, Lion)):
        raise ValueError(
            f"offload_optimizer with a client optimizer ({type(optimizer).__name__}): use "
            "zeroshard.ops.adam.CPUAdam (DeepSpeedCPUAdam), zeroshard.ops.adagrad.CPUAdagrad (DeepSpeedCPUAdagrad), "
            "zeroshard.optim.Lion (DeepSpeedCPULion) or an 'optimizer' config block, or set "
            '"zero_force_ds_cpu_optimizer": false to step it on the CPU anyway'
        )


def update_rule(optimizer: torch.optim.Optimizer) -> str:
    """The update rule an optimizer applies, as a checkpoint records it. Adam and AdamW differ only in how they decay
    weights (torch's AdamW, DeepSpeed's CPU and fused Adams are one class with a flag), so that flag names them."""
    if isinstance(optimizer, torch.optim.Adam):
        return "AdamW" if optimizer.param_groups[0].get("decoupled_weight_decay") else "Adam"
    return type(optimizer).__name__
