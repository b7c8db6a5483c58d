"""Optimizers by DeepSpeed name, and the check that a client optimizer is safe to shard."""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch

from ..ops.adagrad import CPUAdagrad
from ..ops.adam import CPUAdam
from . import hyperparams
from .lamb import Lamb, ShardedNorms
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

# Optimizers whose update is elementwise (or shard-aware, like our Lamb): exact on flat ZeRO shards.
SHARD_SAFE = (
    torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad, Lion, Lamb, OneBitAdam, MuonWithAuxAdam
)  # fmt: skip


def _kernel_flags(cls, params: dict[str, Any]) -> dict[str, Any]:
    """Prefer torch's fused kernel, else foreach, unless the user chose."""
    if "fused" in params or "foreach" in params:
        return {}
    accepted = inspect.signature(cls).parameters
    if "fused" in accepted:
        return {"fused": True}
    return {"foreach": True} if "foreach" in accepted else {}


def build_optimizer(
    name: str,
    params: dict[str, Any],
    param_groups: list[dict],
    *,
    zero_stage: int,
    allow_untested: bool,
    sharded_norms: Optional[ShardedNorms] = None,
) -> torch.optim.Optimizer:
    """The optimizer ``optimizer.type`` names over ``param_groups``; ``sharded_norms`` reaches Lamb (the ZeRO
    shards' parameter ranges, for its per-parameter trust ratios)."""
    key = name.lower()
    params = dict(params)
    if key in NOT_IMPLEMENTED:
        raise NotImplementedError(
            f"optimizer.type '{name}' is not implemented in zeroshard; use Adam, AdamW, Lamb or Lion"
        )
    if key in OPTIMIZER_KEYS:
        unknown = sorted(set(params) - OPTIMIZER_KEYS[key])
        if unknown:
            raise ValueError(
                f"unknown config key 'optimizer.params.{unknown[0]}' for optimizer '{name}'; "
                f"accepted: {sorted(OPTIMIZER_KEYS[key])}"
            )
    params = hyperparams.check("optimizer.params.", params)
    if key in ("adam", "adamw"):
        adam_w_mode = params.pop("adam_w_mode", True)
        if key == "adamw" and adam_w_mode is False:
            raise ValueError("optimizer 'AdamW' with optimizer.params.adam_w_mode false is contradictory; use 'Adam'")
        if params.pop("bias_correction", True) is not True:
            raise NotImplementedError("optimizer.params.bias_correction false is not supported for Adam")
        for ignored in ("torch_adam", "set_grad_none"):
            params.pop(ignored, None)
        cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
        if "betas" in params:
            params["betas"] = tuple(params["betas"])
    elif key == "lamb":
        params.pop("max_grad_norm", None)  # DeepSpeed's FusedLamb ignores it too: clipping is gradient_clipping
        cls = Lamb
        params["sharded_norms"] = sharded_norms
    elif key in ONEBIT:
        cls = ONEBIT[key]
        if key != "onebitadam" and zero_stage > 0:
            raise NotImplementedError(
                f"optimizer.type '{name}' runs with zero_optimization.stage 0 only: "
                + (
                    "its local steps need every rank to hold the whole optimizer state"
                    if key == "zerooneadam"
                    else "its compressed momentum and trust ratios need every rank to hold whole parameters' momentum"
                )
                + "; use stage 0, or OneBitAdam, which runs with ZeRO stages 0-3"
            )
        if key in ("onebitlamb", "zerooneadam"):  # the shards' layout, and at stage 0 the compressed all-reduce
            params["sharded_norms"] = sharded_norms
        if "betas" in params:
            params["betas"] = tuple(params["betas"])
    elif key == "muon":
        if sharded_norms is None:
            raise NotImplementedError(
                "optimizer.type 'Muon' with this offload_optimizer: Muon orthogonalizes whole matrices, gathered from "
                "each flat group's shards, so the optimizer state must be in host memory (device 'cpu', not 'nvme') "
                "with each flat group's shard in one sub-group (zero_optimization.sub_group_size at least "
                "reduce_bucket_size / ranks; its default 1e9 is)"
            )
        for split in ("muon_lr", "adam_lr"):  # applied per half by muon_param_groups
            params.pop(split, None)
        params.setdefault("ns_method", "gram")  # DeepSpeed's default: Gram Newton-Schulz in fp16
        params["sharded"] = sharded_norms
        cls = MuonWithAuxAdam
    elif key == "lion":
        cls = Lion
    elif key == "sgd":
        cls = torch.optim.SGD
    elif key == "adagrad":
        cls = torch.optim.Adagrad
    else:
        cls = getattr(torch.optim, name, None)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise ValueError(f"config key 'optimizer.type' = {name!r}: no such optimizer in zeroshard or torch.optim")
        if zero_stage > 0 and not allow_untested:
            raise ValueError(
                f"optimizer.type '{name}' is not verified with ZeRO sharding (its update may not be elementwise); "
                'set "zero_allow_untested_optimizer": true to use it anyway'
            )
    try:
        return cls(param_groups, **params, **_kernel_flags(cls, params))
    except TypeError as err:
        raise ValueError(f"optimizer '{name}' rejected optimizer.params {params}: {err}") from None


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
