"""Stage 3 parameters: the user's ``nn.Parameter`` objects stay in place, their data comes and goes.

While a parameter is sharded its ``.data`` is an empty placeholder. To turn a silent read of that
placeholder into a clear error, the parameter's class becomes :class:`ZeroParameter` (a subclass of
``nn.Parameter``, so ``isinstance`` checks and optimizers still work) whose ``__torch_function__``
refuses data access while the parameter is sharded. Which parameters are sharded, and their global
shapes, live in a registry here, not in attributes on the parameter.
"""

from __future__ import annotations

import weakref
from enum import Enum

import torch
from torch._C import DisableTorchFunctionSubclass


class ShardedParameterError(RuntimeError):
    """A stage-3 parameter's data was read while it was sharded."""


# id(param) -> (name, global shape, how to reach its data)
_SHARDED: dict[int, tuple[str, torch.Size, str]] = {}
_SHARDED_HINT = (
    "is sharded by ZeRO stage 3 and has no data outside forward/backward; read or modify it inside "
    "`with zeroshard.zero.GatheredParameters([param]):` (add modifier_rank=0 to keep changes)"
)
_FINALIZERS: dict[int, weakref.finalize] = {}  # id(param) -> the hook that drops its entry when it is collected
_PENDING_HINT = (
    "was built under zero.Init and has no data until zeroshard.initialize; write it inside "
    "`with zeroshard.zero.GatheredParameters([param], modifier_rank=0):` (as Hugging Face's from_pretrained does) "
    "or after initialize"
)

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
# A parameter still waiting for data is a meta tensor: a detached alias of it (``module.state_dict()`` for the
# key names, as Hugging Face's loader asks before loading) holds no data to read either.
_PENDING_PASSTHROUGH = {torch.Tensor.detach}
_GLOBAL_SHAPE = {
    torch.Tensor.shape.__get__,
    torch.Tensor.size,
    torch.Tensor.numel,
    torch.Tensor.dim,
    torch.Tensor.ndim.__get__,
    torch.Tensor.nelement,
}


class ZeroParameter(torch.nn.Parameter):
    # DeepSpeed's per-parameter attributes, read by clients (Lightning's model summary, HF's parameter counts):
    # computed from zeroshard's records on each access, nothing is stored on the parameter.
    @property
    def ds_shape(self) -> torch.Size:
        """The full (unsharded) shape."""
        return _full_shape(self)

    @property
    def ds_numel(self) -> int:
        return _full_shape(self).numel()

    @property
    def ds_status(self) -> "ZeroParamStatus":
        """Whether the data is present (gathered) now."""
        return ZeroParamStatus.NOT_AVAILABLE if id(self) in _SHARDED else ZeroParamStatus.AVAILABLE

    @property
    def ds_id(self) -> int:
        """A number unique to the parameter in this process."""
        return id(self)

    def partition_numel(self) -> int:
        """Elements of this parameter inside this rank's shard."""
        return _partition_numel(self)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _SHARDED:
            sharded = _first_sharded(args)
            if sharded is not None:
                name, shape, hint = _SHARDED[id(sharded)]
                if func in _GLOBAL_SHAPE:
                    return _global_shape_answer(func, shape, args[1:])
                if func not in _PASSTHROUGH and not (hint is _PENDING_HINT and func in _PENDING_PASSTHROUGH):
                    raise ShardedParameterError(
                        f"parameter '{name}' {tuple(shape)} {hint} ({getattr(func, '__name__', func)} was called on it)"
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
    """Give a parameter the class that guards its data (identity and autograd state are unchanged). Idempotent."""
    if type(param) is torch.nn.Parameter:
        param.__class__ = ZeroParameter
        _FINALIZERS[id(param)] = weakref.finalize(param, _drop, id(param))
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
    _SHARDED[id(param)] = (name, torch.Size(shape), _SHARDED_HINT)


def guard_pending(param: torch.nn.Parameter, name: str) -> None:
    """Refuse access to a zero.Init parameter that has no data yet (a meta tensor would take writes silently)."""
    adopt(param)
    _SHARDED[id(param)] = (name, param.shape, _PENDING_HINT)


def forget(param: torch.nn.Parameter) -> None:
    """The parameter is getting data by other means (materialization, which swaps tensors and needs the
    parameter free of weak references): stop refusing access to it and drop its clean-up hook."""
    _SHARDED.pop(id(param), None)
    finalizer = _FINALIZERS.pop(id(param), None)
    if finalizer is not None:
        finalizer.detach()


def _drop(key: int) -> None:
    _SHARDED.pop(key, None)
    _FINALIZERS.pop(key, None)


def is_sharded(param: torch.nn.Parameter) -> bool:
    return id(param) in _SHARDED


class ZeroParamStatus(Enum):
    """DeepSpeed's names for whether a stage-3 parameter's data is present."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


def _full_shape(param: torch.nn.Parameter) -> torch.Size:
    entry = _SHARDED.get(id(param))
    if entry is not None:
        return entry[1]
    with DisableTorchFunctionSubclass():
        return param.shape


def _partition_numel(param: torch.nn.Parameter) -> int:
    """Elements of this parameter inside this rank's shard of its flat group (all of them when not sharded)."""
    from .gathered import OWNERS  # the flat groups import this module

    flat = OWNERS.get(id(param))
    if flat is None or not flat.partitioned:
        return _full_shape(param).numel()
    position = next(i for i, p in enumerate(flat.params) if p is param)
    slot = flat.layout.slots[position]
    return sum(s.numel for s in flat.layout.segments(flat.shard_rank) if s.slot == slot)


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """DeepSpeed's way to make a module gather a parameter another module registers. zeroshard gathers by gather
    unit: a parameter used by a module other than its owner must belong to a unit that contains both, so this is
    refused with the way to get that, rather than accepted and ignored."""
    raise NotImplementedError(
        f"zero.register_external_parameter({type(module).__name__}, ...): zeroshard gathers a parameter with the "
        "gather unit of the module that registers it. Make a module that contains both the user and the owner a "
        "gather unit (zero_optimization.gather_unit_classes), or register the parameter on the module that uses it"
    )
