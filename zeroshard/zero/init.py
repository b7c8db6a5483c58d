"""``zero.Init``: build a model without ever holding all of its parameters.

Inside the context every parameter registered on a module is replaced by a meta-device parameter
right away (so construction holds at most one real parameter at a time; buffers stay real).
``zeroshard.initialize`` then materializes the parameters one flat group at a time, just before that
group is sharded, and each rank keeps only its shard.

Values: each module's parameters are initialized by its ``reset_parameters()`` (then ``param_init_fn``
if given) under a generator seeded from the Init seed and the module's path, so the result does not
depend on the order of materialization and is identical on every rank. Initialization code that ran
in ``__init__`` on the parameters themselves (e.g. ``self.apply(custom_init)``) acted on meta tensors
and is not replayed: pass it as ``param_init_fn``; a Hugging Face model's own ``_init_weights`` is used when
none is given. A module with parameters and neither is refused (its values would be uninitialized memory).
:func:`reset_parameters` applies the same values to a model built normally (for references and tests).

Writing weights before ``initialize`` (how Hugging Face's ``from_pretrained`` loads under ZeRO-3): inside
``GatheredParameters(params, modifier_rank=r)`` a parameter that has no data yet is materialized (its
module's initial values, seeded by the Init seed and the parameter's registration order, the same on every
rank), the modifier writes it, and at exit rank ``r``'s values are broadcast and kept; ``initialize`` then
shards those values instead of initial ones. After the Init context has closed, any other access to a
parameter with no data raises :class:`~zeroshard.zero.ShardedParameterError` naming it: a load that would
have been a silent no-op on a meta tensor is an error.
"""

from __future__ import annotations

import contextlib
import weakref
import zlib
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.nn as nn
from torch.nn.modules.module import register_module_parameter_registration_hook

from ..config import parse_config
from .sharded_param import InitRecipe, ParamRecords, records_of

ParamInitFn = Callable[[nn.Module], None]
_IGNORED_DEEPSPEED_ARGS = {
    "data_parallel_group",
    "mem_efficient_linear",
    "pin_memory",
    "mpu",
    "sequence_data_parallel_group",
    "zero_param_parallel_group",
    "zero_quantized_weights",
    "zero_quantized_nontrainable_weights",
}


class Init:
    def __init__(
        self,
        module: Optional[nn.Module] = None,
        config_dict_or_path: Any = None,
        config: Any = None,
        enabled: bool = True,
        dtype: Optional[torch.dtype] = None,
        remote_device: Optional[str] = None,
        param_init_fn: Optional[ParamInitFn] = None,
        seed: Optional[int] = None,
        **deepspeed_args: Any,
    ):
        unknown = set(deepspeed_args) - _IGNORED_DEEPSPEED_ARGS
        if unknown:
            raise TypeError(f"zero.Init got unexpected argument(s) {sorted(unknown)}")
        if module is not None:
            raise NotImplementedError(
                "zero.Init(module=...) (partitioning an existing model): pass the model "
                "to zeroshard.initialize with stage 3 instead"
            )
        if remote_device not in (None, "cpu", "none"):
            raise NotImplementedError(f"zero.Init(remote_device={remote_device!r}): parameter offload is not available")
        source = config_dict_or_path if config_dict_or_path is not None else config
        if source is not None:
            stage = parse_config(source).zero_optimization.stage
            if stage != 3:
                raise ValueError(f"zero.Init builds stage-3 models, but the config has zero_optimization.stage {stage}")
        self.enabled = enabled
        self.dtype = dtype
        self.param_init_fn = param_init_fn
        self.seed = (torch.initial_seed() if seed is None else seed) % 2**63  # fits the int64 broadcast
        # the parameters this context builds, and how to give them values, until initialize shards them
        self.records = ParamRecords()
        self._created: list[tuple[nn.Parameter, str]] = []  # until __exit__ guards them
        self._registration: Optional[contextlib.ExitStack] = None

    def _on_meta(self, module: nn.Module, name: str, param: nn.Parameter) -> nn.Parameter:
        dtype = self.dtype or param.dtype
        meta = nn.Parameter(torch.empty_like(param, device="meta", dtype=dtype), requires_grad=param.requires_grad)
        self.records.add_pending(
            meta, InitRecipe(self.seed, self.param_init_fn, weakref.ref(module), len(self._created))
        )
        self._created.append((meta, f"{type(module).__name__}.{name}"))
        return meta

    def __enter__(self) -> "Init":
        if self.enabled:
            self._registration = contextlib.ExitStack()
            self._registration.enter_context(parameters_replaced(self._on_meta))
        return self

    def __exit__(self, *exc) -> None:
        if self._registration is not None:
            self._registration.close()
            self._registration = None
        # construction is over: from here a write to a parameter still without data is an error, not a no-op
        for param, name in self._created:
            if param.is_meta:
                self.records.guard_pending(param, name)
        self._created.clear()


@contextlib.contextmanager
def parameters_replaced(replace: Callable[[nn.Module, str, nn.Parameter], nn.Parameter]) -> Iterator[None]:
    """While open, every real parameter a module registers is replaced by ``replace(module, name, param)`` (through
    torch's parameter-registration hook: nothing of ``nn.Module`` is patched). Used by zero.Init and
    ``init_empty_weights`` to build models on the meta device."""

    def hook(module: nn.Module, name: str, param: nn.Parameter) -> Optional[nn.Parameter]:
        return None if param.is_meta else replace(module, name, param)

    handle = register_module_parameter_registration_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def _module_seed(seed: int, path: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(path.encode())) % (2**63)


def _canonical_owners(root: nn.Module) -> dict[int, tuple[str, nn.Module]]:
    """id(param) -> the first module (in named_modules order) that registers it."""
    owners: dict[int, tuple[str, nn.Module]] = {}
    for path, module in root.named_modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), (path, module))
    return owners


def _give_data(param: nn.Parameter, data: torch.Tensor) -> None:
    """A meta tensor's data cannot be replaced in place: swap in a real one, keeping the parameter object and
    the attributes clients set on it (``swap_tensors`` swaps those too)."""
    records = records_of(param)
    if records is not None:
        records.forget(param)
    real = nn.Parameter(data, requires_grad=param.requires_grad)
    real.__dict__.update(param.__dict__)
    torch.utils.swap_tensors(param, real)


def _reset_module(
    path: str,
    module: nn.Module,
    seed: int,
    param_init_fn: Optional[ParamInitFn],
    owned: set[int],
    device: torch.device,
    about_to_be_written: bool = False,
) -> None:
    """Initialize the parameters in ``owned`` (meta ones get storage first), leaving the module's others (tied ones
    owned elsewhere, ones already materialized or loaded) as they are. A module nothing can initialize is refused,
    unless its parameters are ``about_to_be_written`` (a load inside GatheredParameters): those start at zero."""
    keep = {  # materialize_pending passes only the parameters still without data as owned
        name: p.detach().clone()
        for name, p in module.named_parameters(recurse=False)
        if id(p) not in owned and not p.is_meta
    }
    meta = [p for p in module.parameters(recurse=False) if p.is_meta]
    uninitializable = param_init_fn is None and not hasattr(module, "reset_parameters")
    if uninitializable and not about_to_be_written and any(id(p) in owned for p in module.parameters(recurse=False)):
        raise ValueError(
            f"zero.Init: module '{path}' ({type(module).__name__}) has parameters but no reset_parameters() and no "
            "param_init_fn was given, so nothing would give them initial values; pass "
            "zero.Init(param_init_fn=...) (e.g. the model's own initialization function) or load pretrained weights"
        )
    for param in meta:
        if id(param) in owned:
            _give_data(param, torch.zeros(param.shape, device=device, dtype=torch.float32))
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(_module_seed(seed, path))
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
        if param_init_fn is not None:
            param_init_fn(module)
        for name, value in keep.items():
            getattr(module, name).copy_(value)


def model_init_fn(root: nn.Module) -> Optional[ParamInitFn]:
    """The model's own per-module initialization, used when zero.Init got no ``param_init_fn``: a Hugging Face
    model's ``_init_weights`` (which its ``post_init()`` applied to meta tensors while it was built)."""
    init = getattr(root, "_init_weights", None)
    return init if callable(init) else None


def reset_parameters(root: nn.Module, seed: int, param_init_fn: Optional[ParamInitFn] = None) -> None:
    """Give a normally built model exactly the initial values a zero.Init build of it materializes."""
    param_init_fn = param_init_fn or model_init_fn(root)
    device = next((p.device for p in root.parameters()), torch.device("cpu"))
    owners = _canonical_owners(root)
    for path, module in root.named_modules():
        owned = {id(p) for p in module.parameters(recurse=False) if owners[id(p)][1] is module}
        if owned:
            _reset_module(path, module, seed, param_init_fn, owned, device)


def has_meta_parameters(module: nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


class Materializer:
    """Materializes meta parameters on demand, one owning module at a time (see the module docstring): with
    their initial values, or read from ``source`` (pretrained weights: an object with ``names`` and
    ``read(name)``, see :mod:`zeroshard.checkpoint.weights`), so each rank reads what it needs itself and keeps
    only its shard once the flat group is built."""

    def __init__(self, root: nn.Module, device: torch.device, seed: int, source: Any = None):
        self.root = root
        self.device = device
        self.seed = seed
        self.source = source
        self.owners = _canonical_owners(root)

    def __call__(self, params) -> None:
        for param in params:
            if not param.is_meta:
                continue
            path, module = self.owners[id(param)]
            if self.source is not None:
                self._read(path, module)
                continue
            pending = _pending(param)
            owned = {id(p) for p in module.parameters(recurse=False) if self.owners[id(p)][1] is module}
            init_fn = (pending and pending.param_init_fn) or model_init_fn(self.root)
            _reset_module(path, module, self.seed, init_fn, owned, self.device)

    def _read(self, path: str, module: nn.Module) -> None:
        for local, param in module.named_parameters(recurse=False):
            if not param.is_meta or self.owners[id(param)][1] is not module:
                continue
            name = f"{path}.{local}" if path else local
            value = self.source.read(name)
            if tuple(value.shape) != tuple(param.shape):
                raise ValueError(
                    f"pretrained weight '{name}' has shape {tuple(value.shape)}, the model {tuple(param.shape)}"
                )
            # a compact copy: what the reader returns may view a larger read buffer, which would stay alive
            _give_data(param, value.to(self.device, torch.float32, copy=True))

    def missing(self) -> list[str]:
        """Parameters without data that the source does not have (with a source, every one must be there)."""
        return sorted(n for n, p in self.root.named_parameters() if p.is_meta and n not in self.source.names)


def _pending(param: nn.Parameter) -> Optional[InitRecipe]:
    records = records_of(param)
    return records.pending(param) if records is not None else None


def pending_seed(module: nn.Module) -> Optional[int]:
    """The seed recorded by the Init context that built this module's parameters, if any."""
    return next((pending.seed for p in module.parameters() if (pending := _pending(p)) is not None), None)


def materialize_pending(params: Iterable[nn.Parameter], device: torch.device) -> list[nn.Parameter]:
    """Give parameters built under zero.Init that have no data yet their initial values now, before
    ``initialize`` (for writes such as a pretrained-weight load). Returns the ones materialized."""
    done = []
    for param in params:
        pending = _pending(param)
        module = pending.module() if pending is not None else None
        if module is None or not param.is_meta:
            continue
        waiting = {id(p): rec for p in module.parameters(recurse=False) if p.is_meta and (rec := _pending(p))}
        owned = set(waiting)
        ordinal = min(rec.ordinal for rec in waiting.values())
        _reset_module(f"#{ordinal}", module, pending.seed, pending.param_init_fn, owned, device, True)
        done.append(param)
    return done


def creation_order(param: nn.Parameter) -> Optional[int]:
    """The registration order of a parameter built under zero.Init (the same on every rank), else None."""
    pending = _pending(param)
    return pending.ordinal if pending is not None else None


def release_pending(params: Iterable[nn.Parameter]) -> None:
    """The parameters are sharded (or whole) now: their zero.Init recipes are no longer needed."""
    for param in params:
        records = records_of(param)
        if records is not None and records.pending(param) is not None:
            records.forget(param)
