"""DeepSpeed's ``deepspeed.utils.safe_get_full_fp32_param`` family: one parameter's master weights, gradient and
optimizer state, whole or this rank's fragment, at every stage and with offload.

DeepSpeed finds the engine through state it hangs on each parameter; zeroshard hangs nothing on parameters, so
these calls look among the engines that ``deepspeed.initialize`` built and that are still alive (``live_engines``)
for the one whose optimizer holds the parameter, and answer through its
:class:`~zeroshard.zero.ParamAccess` (``engine.param_access``). Frozen parameters answer ``None``, as in DeepSpeed.
The *full* calls are collectives: every rank of the parameter's shard group calls them together.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from zeroshard.zero import ParamAccess

from .live_engines import alive


def _access(param: torch.nn.Parameter) -> Optional[ParamAccess]:
    if not isinstance(param, torch.nn.Parameter):
        raise TypeError(f"expected a model parameter, got {type(param).__name__}")
    engines = alive()
    for engine in engines:
        if engine.stack.access is not None and engine.records.flat_of(param) is not None:
            return engine.param_access
    if any(any(p is param for p in engine.module.parameters()) for engine in engines):
        return None  # an engine's frozen parameter
    raise ValueError(
        f"parameter {tuple(param.shape)} belongs to no live engine built by deepspeed.initialize (with an "
        "optimizer); for an engine from zeroshard.initialize use engine.param_access"
    )


def _answer(param: torch.nn.Parameter, read: Callable[..., Optional[torch.Tensor]], *key: str):
    access = _access(param)
    return None if access is None else read(access, param, *key)


def safe_get_full_fp32_param(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    return _answer(param, ParamAccess.full_fp32_param)


def safe_get_full_grad(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    return _answer(param, ParamAccess.full_grad)


def safe_get_full_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> Optional[torch.Tensor]:
    return _answer(param, ParamAccess.full_optimizer_state, optim_state_key)


def safe_get_local_fp32_param(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    return _answer(param, ParamAccess.local_fp32_param)


def safe_get_local_grad(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    return _answer(param, ParamAccess.local_grad)


def safe_get_local_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> Optional[torch.Tensor]:
    return _answer(param, ParamAccess.local_optimizer_state, optim_state_key)


def safe_set_full_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    _required(param).set_full_fp32_param(param, value)


def safe_set_full_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    _required(param).set_full_optimizer_state(param, value, optim_state_key)


def safe_set_local_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    _required(param).set_local_fp32_param(param, value)


def safe_set_full_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    _required(param).set_full_grad(param, value)


def safe_set_local_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    _required(param).set_local_grad(param, value)


def safe_update_full_grad_vectorized(param_list: list, update_func: Callable) -> None:
    """``update_func(full_grad, param)`` becomes each parameter's full gradient (a collective, like the full
    reads): for a parameter holding ``.grad`` (no engine, or between accumulation boundaries) that ``.grad``, else
    the reduced gradient its engine's next step applies. Frozen parameters are skipped."""
    for param in param_list:
        if param.grad is not None:
            param.grad.copy_(update_func(param.grad, param))
        elif param.requires_grad:
            access = _required(param)
            access.set_full_grad(param, update_func(access.full_grad(param), param))


def safe_set_local_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    _required(param).set_local_optimizer_state(param, value, optim_state_key)


def _required(param: torch.nn.Parameter) -> ParamAccess:
    access = _access(param)
    if access is None:
        raise ValueError(f"parameter {tuple(param.shape)} is frozen: it has no fp32 master or optimizer state to set")
    return access


__all__ = [
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
    "safe_update_full_grad_vectorized",
]
