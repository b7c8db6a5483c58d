"""Stage 3 parameters: the user's ``nn.Parameter`` objects stay in place, their data comes and goes.

While a parameter is sharded its ``.data`` is an empty placeholder. To turn a silent read of that
placeholder into a clear error, the parameter's class becomes a :class:`ZeroParameter` (a subclass of
``nn.Parameter``, so ``isinstance`` checks and optimizers still work) whose ``__torch_function__``
refuses data access while the parameter has no data. What is known about each parameter (sharded or
not, its global shape, its flat group, how a zero.Init build gives it values) lives in a
:class:`ParamRecords` that its owner holds: an engine, or a zero.Init context. Each records object binds
its own subclass of ``ZeroParameter`` to itself, so a parameter finds its records through its class;
nothing is stored on the parameter and no table is process-wide.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from enum import Enum
from typing import Any, Optional

import torch
from torch._C import DisableTorchFunctionSubclass
from torch.utils.weak import WeakIdKeyDictionary

from .. import comm
from ..accelerator import get_accelerator


class ShardedParameterError(RuntimeError):
    """A stage-3 parameter's data was read while it was sharded."""


SHARDED_HINT = (
    "is sharded by ZeRO stage 3 and has no data outside forward/backward; read or modify it inside "
    "`with zeroshard.zero.GatheredParameters([param]):` (add modifier_rank=0 to keep changes)"
)
PENDING_HINT = (
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
    torch._has_compatible_shallow_copy_type,  # asked by module._apply (module.cpu())
}
# A parameter still waiting for data is a meta tensor: a detached alias of it (``module.state_dict()`` for the
# key names, as Hugging Face's loader asks before loading) holds no data to read either.
_PENDING_PASSTHROUGH = {torch.Tensor.detach}
_SET_DATA = torch.Tensor.data.__set__
_DEVICE = torch.Tensor.device.__get__
_GLOBAL_SHAPE = {
    torch.Tensor.shape.__get__,
    torch.Tensor.size,
    torch.Tensor.numel,
    torch.Tensor.dim,
    torch.Tensor.ndim.__get__,
    torch.Tensor.nelement,
}


class AdoptedParameter(torch.nn.Parameter):
    """The class of a parameter an owner adopted while it keeps its data (ZeRO stages 0-2): it finds its owner's
    records through its class and nothing else changes (no ``__torch_function__`` of its own, so torch keeps its
    fast path, and no DeepSpeed ``ds_*`` attributes, which clients read as "ZeRO-3"). Never instantiated
    directly: :meth:`ParamRecords.adopt` gives a parameter its records' subclass."""

    _records: "ParamRecords"  # set on each records object's subclass


class ZeroParameter(AdoptedParameter):
    """The class of a parameter zeroshard manages under stage 3 (see the module docstring). Never instantiated
    directly: :meth:`ParamRecords.adopt` gives a parameter its records' subclass."""

    # DeepSpeed's per-parameter attributes, read by clients (Lightning's model summary, HF's parameter counts):
    # computed from the records on each access, nothing is stored on the parameter.
    @property
    def ds_shape(self) -> torch.Size:
        """The full (unsharded) shape."""
        return self._records.full_shape(self)

    @property
    def ds_numel(self) -> int:
        return self._records.full_shape(self).numel()

    @property
    def ds_status(self) -> "Availability":
        """Whether the data is present (gathered) now."""
        return Availability.NOT_AVAILABLE if self._records.has_no_data(self) else Availability.AVAILABLE

    @property
    def ds_id(self) -> int:
        """A number unique to the parameter in this process."""
        return id(self)

    def partition_numel(self) -> int:
        """Elements of this parameter inside this rank's shard."""
        return self._records.partition_numel(self)

    @property
    def ds_tensor(self) -> torch.Tensor:
        """This rank's piece of the compute values, flat (``partition_numel()`` elements; a copy: DeepSpeed's
        partition tensor, which clients read for its shape and values; write through ``param_access``)."""
        return self._records.partition_values(self)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # Note [hooks outside compiled graphs]: a compiled unit runs only between its gather and its free, so every
        # parameter it reads has data; tracing the check would guard each graph on its parameters' identities
        missing = None if torch.compiler.is_compiling() else _first_without_data(args)
        if missing is not None:
            name, shape, hint = missing
            if func in _GLOBAL_SHAPE:
                return _global_shape_answer(func, shape, args[1:])
            if _moves_device_only(func, args, kwargs):
                return args[0]  # module.cpu() / .to(device): where a shard lives is the engine's to decide
            if func == _SET_DATA and args[1] is args[0]:
                return None  # what module._apply does with the answer above
            if func == _DEVICE and hint is PENDING_HINT:
                # the device it will have (DeepSpeed's partitioned parameters answer theirs): clients ask the model's
                # device after from_pretrained (Hugging Face's kernelize), before any has data
                return get_accelerator().device(comm.backend.local_rank())
            if func not in _PASSTHROUGH and not (hint is PENDING_HINT and func in _PENDING_PASSTHROUGH):
                raise ShardedParameterError(
                    f"parameter '{name}' {tuple(shape)} {hint} ({getattr(func, '__name__', func)} was called on it)"
                )
        with DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def _first_without_data(args) -> Optional[tuple[str, torch.Size, str]]:
    for arg in args:
        if isinstance(arg, ZeroParameter):
            entry = arg._records.no_data.get(id(arg))
            if entry is not None:
                return entry
        elif isinstance(arg, (list, tuple)):
            for item in arg:
                if isinstance(item, ZeroParameter) and (entry := item._records.no_data.get(id(item))) is not None:
                    return entry
    return None


def _moves_device_only(func, args, kwargs) -> bool:
    if func is torch.Tensor.cpu:
        return True
    if func is not torch.Tensor.to:
        return False
    _, dtype, _, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
    return dtype is None or dtype == args[0].dtype


def _global_shape_answer(func, shape: torch.Size, rest):
    if func is torch.Tensor.numel or func is torch.Tensor.nelement:
        return shape.numel()
    if func is torch.Tensor.dim or func == torch.Tensor.ndim.__get__:
        return len(shape)
    if func is torch.Tensor.size and rest:
        return shape[rest[0]]
    return shape


@dataclass(frozen=True)
class InitRecipe:
    """How to give a parameter registered inside a zero.Init context its initial value."""

    seed: int
    param_init_fn: Any  # Optional[Callable[[nn.Module], None]]
    module: weakref.ref  # the module that registered it
    ordinal: int  # registration order inside its Init context: a rank-independent identity before paths exist
    initial: Any  # the value its module's __init__ left, put away (zero.init: Replayed, Constant or Sharded)


class ParamRecords:
    """What one owner (an engine, a zero.Init context) knows about the parameters it adopted.

    ``no_data`` maps ``id(param)`` to (name, full shape, hint) while the parameter has no data (sharded, or
    built under zero.Init and not materialized yet); it is keyed by id, read on every torch call on the
    parameter, and each entry is dropped when its parameter is collected. The flat group holding a parameter,
    the object keeping its master weights (``keeper``: ``overwrite(flat, values)``), its zero.Init recipe and the
    ranks holding the same value of it (``holders``) are kept in weak, identity-keyed maps, each written by the
    object it names when that object is built (the holders by the engine that adopts the parameter)."""

    def __init__(self):
        self.no_data: dict[int, tuple[str, torch.Size, str]] = {}
        self._finalizers: dict[int, weakref.finalize] = {}
        self._flats = WeakIdKeyDictionary()  # param -> its flat group
        self._keepers = WeakIdKeyDictionary()  # flat group -> the object keeping its master weights
        self._pending = WeakIdKeyDictionary()  # param -> InitRecipe
        self._holders = WeakIdKeyDictionary()  # param -> the group of ranks holding the same value of it
        module = ZeroParameter.__module__
        self.param_class = type("ZeroParameter", (ZeroParameter,), {"_records": self, "__module__": module})
        self.whole_class = type("AdoptedParameter", (AdoptedParameter,), {"_records": self, "__module__": module})
        self._subclasses: dict[tuple[type, type], type] = {}  # (base, a parameter subclass) -> its class here

    # -- adoption and data presence ------------------------------------------------------------
    def adopt(self, param: torch.nn.Parameter, *, whole: bool = False, holders=None) -> None:
        """Give a parameter this records' class (identity and autograd state are unchanged): ``param_class``, which
        guards data access and answers DeepSpeed's ``ds_*`` attributes (stage 3, zero.Init), or with ``whole``
        ``whole_class``, which only links the parameter to these records (stages 0-2). A parameter another records
        object adopted (zero.Init's) moves here once it has data. ``holders``: the ranks holding the same value of
        it (a ``comm.Group``; ``GatheredParameters`` broadcasts a modifier's values among them). Idempotent."""
        if holders is not None:
            self._holders[param] = holders
        cls = self._class_for(type(param), self.whole_class if whole else self.param_class)
        if type(param) is cls:
            return
        if isinstance(param, ZeroParameter) and param._records.no_data.get(id(param)) is not None:
            raise AssertionError("a parameter without data cannot change owner")
        param.__class__ = cls

    def _class_for(self, cls: type, base: type) -> type:
        """This records' class deriving from ``base`` for a parameter of class ``cls``: ``base`` itself for a plain
        parameter (or one some records object adopted); for a parameter subclass (bitsandbytes' ``Params4bit``) a
        class deriving from both, so ``isinstance`` checks against the original class still hold."""
        original = next(c for c in cls.__mro__ if not issubclass(c, AdoptedParameter))  # before any adoption
        if original is torch.nn.Parameter:
            return base
        if (base, original) not in self._subclasses:
            prefix = "Zero" if base is self.param_class else "Adopted"
            name = f"{prefix}{original.__name__}"
            self._subclasses[(base, original)] = type(name, (base, original), {"__module__": base.__module__})
        return self._subclasses[(base, original)]

    def holders(self, param: torch.nn.Parameter):
        """The group of ranks holding the same value of ``param`` (a ``comm.Group``), or None when its owner did not
        say (zero.Init before ``initialize``: every rank holds the whole model)."""
        return self._holders.get(param)

    def bind(self, param: torch.nn.Parameter, data: torch.Tensor) -> None:
        """Point the parameter at gathered data."""
        self.no_data.pop(id(param), None)
        with DisableTorchFunctionSubclass():
            param.data = data

    def release(self, param: torch.nn.Parameter, name: str, shape: torch.Size) -> None:
        """Drop the parameter's data; until the next ``bind`` any read raises :class:`ShardedParameterError`."""
        with DisableTorchFunctionSubclass():
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        self._mark(param, (name, torch.Size(shape), SHARDED_HINT))

    def _mark(self, param: torch.nn.Parameter, entry: tuple[str, torch.Size, str]) -> None:
        key = id(param)
        self.no_data[key] = entry
        if key not in self._finalizers:  # once per parameter: its id must not outlive it in ``no_data``
            self._finalizers[key] = weakref.finalize(param, self._collected, key)

    def _collected(self, key: int) -> None:
        self.no_data.pop(key, None)
        self._finalizers.pop(key, None)

    def has_no_data(self, param: torch.nn.Parameter) -> bool:
        return id(param) in self.no_data

    def full_shape(self, param: torch.nn.Parameter) -> torch.Size:
        entry = self.no_data.get(id(param))
        if entry is not None:
            return entry[1]
        with DisableTorchFunctionSubclass():
            return param.shape

    # -- flat groups ---------------------------------------------------------------------------
    def place(self, flat) -> None:
        """Record that ``flat`` holds each of ``flat.params`` (the flat group calls this when it is built)."""
        for param in flat.params:
            self._flats[param] = flat

    def keep(self, flat, keeper) -> None:
        """Record ``keeper`` as the object keeping ``flat``'s master weights (the optimizer state calls this when
        it is built; a frozen flat group has none: its compute-precision shard is its only copy)."""
        self._keepers[flat] = keeper

    def flat_of(self, param: torch.nn.Parameter):
        """(flat group, keeper) of a parameter, or None when it is in no flat group (not yet sharded); the keeper is
        None for a frozen flat group."""
        flat = self._flats.get(param)
        return None if flat is None else (flat, self._keepers.get(flat))

    def partition_numel(self, param: torch.nn.Parameter) -> int:
        """Elements of this parameter inside this rank's shard of its flat group (all of them when not sharded)."""
        flat = self._flats.get(param)
        if flat is None or not flat.partitioned:
            return self.full_shape(param).numel()
        slot = flat.layout.slots[next(i for i, p in enumerate(flat.params) if p is param)]
        return sum(s.numel for s in flat.layout.segments(flat.shard_rank) if s.slot == slot)

    def partition_values(self, param: torch.nn.Parameter) -> torch.Tensor:
        """A copy of this rank's piece of the parameter's compute values (1-D, ``partition_numel`` elements)."""
        flat = self._flats.get(param)
        if flat is None:
            raise ValueError("ds_tensor: the parameter belongs to no flat group yet (initialize shards it)")
        slot = flat.layout.slots[next(i for i, p in enumerate(flat.params) if p is param)]
        shard = flat.shard_values()
        pieces = [shard[s.shard_start : s.shard_start + s.numel] for s in flat.layout.segments(flat.shard_rank)
                  if s.slot == slot]  # fmt: skip
        return torch.cat(pieces).detach().clone() if pieces else shard.new_empty(0)

    # -- zero.Init ------------------------------------------------------------------------------
    def add_pending(self, param: torch.nn.Parameter, pending: InitRecipe) -> None:
        """A parameter a zero.Init context registered on the meta device, and how to give it values."""
        self.adopt(param)
        self._pending[param] = pending

    def guard_pending(self, param: torch.nn.Parameter, name: str) -> None:
        """Construction is over: refuse access to the parameter while it has no data (a meta tensor would take
        writes silently)."""
        with DisableTorchFunctionSubclass():
            shape = param.shape
        self._mark(param, (name, shape, PENDING_HINT))

    def pending(self, param: torch.nn.Parameter) -> Optional[InitRecipe]:
        return self._pending.get(param)

    def forget(self, param: torch.nn.Parameter) -> None:
        """The parameter gets data by other means (materialization swaps tensors, which needs the parameter free
        of weak references): drop every record of it. Its recipe stays readable until then via ``pending``."""
        self.no_data.pop(id(param), None)
        finalizer = self._finalizers.pop(id(param), None)
        if finalizer is not None:
            finalizer.detach()
        self._pending.pop(param, None)
        self._flats.pop(param, None)


def records_of(param: torch.nn.Parameter) -> Optional[ParamRecords]:
    """The records of the owner that adopted ``param``, if any."""
    return param._records if isinstance(param, AdoptedParameter) else None


class Availability(Enum):
    """Whether a stage-3 parameter's data is present (DeepSpeed's ``ZeroParamStatus``: the members keep its names, and
    ``ds_status`` answers with them)."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3
