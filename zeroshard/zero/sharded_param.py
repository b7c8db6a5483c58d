"""Stage 3 parameters: the user's ``nn.Parameter`` objects stay in place, their data comes and goes.

While a parameter is sharded its ``.data`` is an empty placeholder. To turn a silent read of that
placeholder into a clear error, the parameter's class becomes :class:`ZeroParameter` (a subclass of
``nn.Parameter``, so ``isinstance`` checks and optimizers still work) whose ``__torch_function__``
refuses data access while the parameter is sharded. Which parameters are sharded, and their global
shapes, live in a registry here, not in attributes on the parameter.
"""

from __future__ import annotations

import weakref

import torch
from torch._C import DisableTorchFunctionSubclass


class ShardedParameterError(RuntimeError):
    """A stage-3 parameter's data was read while it was sharded."""


_SHARDED: dict[int, tuple[str, torch.Size]] = {}  # id(param) -> (fully qualified name, global shape)

# Metadata that stays answerable while sharded; everything else touches data and is refused.
_PASSTHROUGH = {
    torch.Tensor.dtype.__get__,
    torch.Tensor.device.__get__,
    torch.Tensor.requires_grad.__get__,
    torch.Tensor.requires_grad.__set__,
    torch.Tensor.requires_grad_,
    torch.Tensor.grad.__get__,
    torch.Tensor.grad.__set__,
    torch.Tensor.is_leaf.__get__,
    torch.Tensor.grad_fn.__get__,
    torch.Tensor.register_hook,
    torch.Tensor.register_post_accumulate_grad_hook,
    torch.Tensor.layout.__get__,
    torch.Tensor.is_floating_point,
    torch.Tensor.element_size,
    torch.Tensor.__hash__,
    torch.Tensor.is_cuda.__get__,
    torch.Tensor.is_sparse.__get__,
    torch.Tensor.is_meta.__get__,
}
_GLOBAL_SHAPE = {
    torch.Tensor.shape.__get__,
    torch.Tensor.size,
    torch.Tensor.numel,
    torch.Tensor.dim,
    torch.Tensor.ndim.__get__,
    torch.Tensor.nelement,
}


class ZeroParameter(torch.nn.Parameter):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _SHARDED:
            sharded = _first_sharded(args)
            if sharded is not None:
                name, shape = _SHARDED[id(sharded)]
                if func in _GLOBAL_SHAPE:
                    return _global_shape_answer(func, shape, args[1:])
                if func not in _PASSTHROUGH:
                    raise ShardedParameterError(
                        f"parameter '{name}' {tuple(shape)} is sharded by ZeRO stage 3 and has no data outside "
                        f"forward/backward ({getattr(func, '__name__', func)} was called on it); read or modify it "
                        "inside `with zeroshard.zero.GatheredParameters([param]):`"
                    )
        with DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def _first_sharded(args):
    for arg in args:
        if isinstance(arg, ZeroParameter) and id(arg) in _SHARDED:
            return arg
        if isinstance(arg, (list, tuple)):
            for item in arg:
                if isinstance(item, ZeroParameter) and id(item) in _SHARDED:
                    return item
    return None


def _global_shape_answer(func, shape: torch.Size, rest):
    if func is torch.Tensor.numel or func is torch.Tensor.nelement:
        return shape.numel()
    if func is torch.Tensor.dim or func == torch.Tensor.ndim.__get__:
        return len(shape)
    if func is torch.Tensor.size and rest:
        return shape[rest[0]]
    return shape


def adopt(param: torch.nn.Parameter) -> None:
    """Give a parameter the class that guards its data (identity and autograd state are unchanged)."""
    if type(param) is torch.nn.Parameter:
        param.__class__ = ZeroParameter
        weakref.finalize(param, _SHARDED.pop, id(param), None)
    elif not isinstance(param, ZeroParameter):
        raise TypeError(f"ZeRO stage 3 cannot shard a parameter of type {type(param).__name__}")


def bind(param: torch.nn.Parameter, data: torch.Tensor) -> None:
    """Point the parameter at gathered data."""
    _SHARDED.pop(id(param), None)
    with DisableTorchFunctionSubclass():
        param.data = data


def release(param: torch.nn.Parameter, name: str, shape: torch.Size) -> None:
    """Drop the parameter's data; until the next ``bind`` any read raises :class:`ShardedParameterError`."""
    with DisableTorchFunctionSubclass():
        param.data = torch.empty(0, dtype=param.dtype, device=param.device)
    _SHARDED[id(param)] = (name, torch.Size(shape))


def is_sharded(param: torch.nn.Parameter) -> bool:
    return id(param) in _SHARDED
