"""Materializing what ``zero.Init`` put away: a parameter built under the context has no data until it is
materialized, one owning module at a time, with the initial value it was put away as (replayed, constant or
sharded: Note [putting initial values away] in ``init.py``) or read from pretrained weights; then the model's own
per-module initialization (``_init_weights`` / ``param_init_fn``) runs on that module under a seed derived from
the Init seed and its path. :class:`Materializer` serves ``initialize`` (one flat group at a time),
:func:`materialize_pending` serves writes before it (``GatheredParameters``), :func:`reset_parameters` gives a
normally built model the same values."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.nn as nn

from .. import comm
from .sharded_param import InitRecipe, records_of

ParamInitFn = Callable[[nn.Module], None]


@dataclass(frozen=True)
class Replayed:
    """The module's ``reset_parameters()`` from this generator state gives its parameters their values."""

    generator_state: torch.Tensor
    device: torch.device


@dataclass(frozen=True)
class Constant:
    """Every element is this number."""

    value: Any


@dataclass(frozen=True)
class Sharded:
    """This rank's slice of the flattened value (rank 0's), ``ceil(numel / world)`` elements per rank."""

    piece: torch.Tensor
    world_size: int


@dataclass(frozen=True)
class Loaded(Sharded):
    """A value written before ``initialize`` (Hugging Face's ``from_pretrained`` under ZeRO-3 writes each module
    inside ``GatheredParameters(modifier_rank=0)``), kept as each rank's slice: it is final, so no initialization
    function runs on it when it is materialized."""


@dataclass(frozen=True)
class Taken:
    """A parameter :func:`materialize_pending` gave data to, and what it had before: :func:`put_back` returns it to
    its owner's records with no data, so nothing model-sized stays on a rank until ``initialize``."""

    param: nn.Parameter
    records: Any  # the zero.Init context's ParamRecords
    recipe: InitRecipe
    guard: Optional[str]  # the name it was guarded under once construction was over, if it was


@contextlib.contextmanager
def generator_at(state: torch.Tensor, device: torch.device) -> Iterator[None]:
    """The default generator of ``device`` set to ``state``, restored on exit."""
    if device.type == "cpu":
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(state)
            yield
        return
    index = device.index if device.index is not None else torch.get_device_module(device.type).current_device()
    with torch.random.fork_rng(devices=[index], device_type=device.type):
        torch.get_device_module(device.type).set_rng_state(state, device)
        yield


@contextlib.contextmanager
def others_kept(module: nn.Module, changing: Iterable[nn.Parameter]) -> Iterator[None]:
    """Re-running initialization code on ``module`` changes only ``changing``: every other real parameter and buffer
    it reaches (tied ones, loaded ones, normalization statistics) gets its value back on exit."""
    skip = {id(p) for p in changing}
    tensors = [t for t in (*module.parameters(), *module.buffers()) if id(t) not in skip and not t.is_meta]
    saved = [t.detach().clone() for t in tensors]
    try:
        yield
    finally:
        with torch.no_grad():
            for tensor, value in zip(tensors, saved):
                tensor.copy_(value)


def initial_data(param: nn.Parameter, initial: Any, world: comm.Group) -> torch.Tensor:
    """The value put away for ``param`` (on the device it was built on); a sharded one is gathered (a collective)."""
    shape, dtype = param.shape, param.dtype
    if isinstance(initial, Replayed):  # reset_parameters() writes it next
        return torch.zeros(shape, dtype=dtype, device=initial.device)
    if isinstance(initial, Constant):
        return torch.full(shape, initial.value, dtype=dtype)
    if initial.world_size != world.size:
        raise RuntimeError(
            f"a zero.Init model built on {initial.world_size} rank(s) is materialized on {world.size}: build and "
            "initialize it in the same process group"
        )
    chunk = math.ceil(shape.numel() / world.size)
    gathered = torch.zeros(chunk * world.size, dtype=dtype, device=initial.piece.device)
    mine = gathered.view(world.size, chunk)[world.rank]
    mine[: initial.piece.numel()].copy_(initial.piece)
    comm.all_gather(gathered.view(torch.uint8), mine.view(torch.uint8), world)
    return gathered[: shape.numel()].view(shape)


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


def _materialize_module(
    module: nn.Module, path: str, seed: int, param_init_fn: Optional[ParamInitFn], world: comm.Group, device
) -> None:
    """Give the module's parameters that are still without data their initial values (see the module docstring),
    then run the initialization that came after its ``__init__`` (``param_init_fn`` or the model's
    ``_init_weights``) seeded by its path, keeping every other parameter and buffer it reaches as it is."""
    waiting = [(p, pending_recipe(p)) for p in module.parameters(recurse=False) if p.is_meta]
    waiting = [(p, recipe) for p, recipe in waiting if recipe is not None and recipe.module() in (module, None)]
    if not waiting:
        return
    params = [p for p, _ in waiting]
    for param, recipe in waiting:
        _give_data(param, initial_data(param, recipe.initial, world))
    replayed = next((r.initial for _, r in waiting if isinstance(r.initial, Replayed)), None)
    initialized = [p for p, r in waiting if not isinstance(r.initial, Loaded)]  # a loaded value is kept as it is
    with torch.no_grad(), others_kept(module, initialized):
        if replayed is not None:
            with generator_at(replayed.generator_state, replayed.device):
                module.reset_parameters()
        if param_init_fn is not None:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(_module_seed(seed, path))
                param_init_fn(module)
    for param in params:
        if param.device != torch.device(device):
            param.data = param.data.to(device)


def model_init_fn(root: nn.Module) -> Optional[ParamInitFn]:
    """The model's own per-module initialization, used when zero.Init got no ``param_init_fn``: a Hugging Face
    model's ``_init_weights`` (which its ``post_init()`` applied to meta tensors while it was built)."""
    init = getattr(root, "_init_weights", None)
    return init if callable(init) else None


def reset_parameters(root: nn.Module, seed: int, param_init_fn: Optional[ParamInitFn] = None) -> None:
    """Give a normally built model the values a zero.Init build of it materializes (with the same global seed before
    each build): its parameters as construction left them, then ``param_init_fn`` or the model's ``_init_weights``
    run on each module under the seed zero.Init uses for it."""
    param_init_fn = param_init_fn or model_init_fn(root)
    if param_init_fn is None:
        return
    owners = _canonical_owners(root)
    for path, module in root.named_modules():
        owned = [p for p in module.parameters(recurse=False) if owners[id(p)][1] is module]
        with torch.no_grad(), others_kept(module, owned):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(_module_seed(seed, path))
                param_init_fn(module)


def has_meta_parameters(module: nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


class Materializer:
    """Materializes meta parameters on demand, one owning module at a time (see the module docstring): with
    their initial values, or read from ``source`` (pretrained weights: an object with ``names`` and
    ``read(name)``, see :mod:`zeroshard.checkpoint.weights`), so each rank reads what it needs itself and keeps
    only its shard once the flat group is built."""

    def __init__(self, root: nn.Module, device: torch.device, seed: int, *, world: comm.Group, source: Any = None):
        self.root = root
        self.device = device
        self.seed = seed
        self.source = source
        self.owners = _canonical_owners(root)
        self.paths = {id(module): path for path, module in root.named_modules()}
        self.world = world  # the engine's mesh's: the gathers of pieces count in its ledger, under its timeouts

    def __call__(self, params) -> None:
        for param in params:
            if not param.is_meta:
                continue
            if self.source is not None:
                self._read(*self.owners[id(param)])
                continue
            pending = pending_recipe(param)
            module = pending.module() or self.owners[id(param)][1]
            init_fn = pending.param_init_fn or model_init_fn(self.root)
            _materialize_module(module, self.paths[id(module)], self.seed, init_fn, self.world, self.device)

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


def pending_recipe(param: nn.Parameter) -> Optional[InitRecipe]:
    records = records_of(param)
    return records.pending(param) if records is not None else None


def pending_seed(module: nn.Module) -> Optional[int]:
    """The seed recorded by the Init context that built this module's parameters, if any."""
    return next((pending.seed for p in module.parameters() if (pending := pending_recipe(p)) is not None), None)


def materialize_pending(params: Iterable[nn.Parameter], device: torch.device) -> list[Taken]:
    """Give parameters built under zero.Init that have no data yet their initial values now, before
    ``initialize`` (for writes such as a pretrained-weight load; a collective, like the gather it serves). Returns
    every parameter that got data (a module materializes together), for :func:`put_back`."""
    taken: list[Taken] = []
    for param in params:
        pending = pending_recipe(param)
        module = pending.module() if pending is not None else None
        if module is None or not param.is_meta:
            continue
        waiting = [(p, rec) for p in module.parameters(recurse=False) if p.is_meta and (rec := pending_recipe(p))]
        for p, rec in waiting:
            records = records_of(p)
            guard = records.no_data.get(id(p))
            taken.append(Taken(p, records, rec, guard[0] if guard is not None else None))
        ordinal = min(rec.ordinal for _, rec in waiting)
        _materialize_module(module, f"#{ordinal}", pending.seed, pending.param_init_fn, comm.world_group(), device)
    return [t for t in taken if not t.param.is_meta]


def put_back(taken: list[Taken], modified: Iterable[nn.Parameter]) -> None:
    """Return parameters :func:`materialize_pending` materialized to their zero.Init owner with no data: with their
    recipe as it was, or, those in ``modified`` (every rank holds the modifier's value of them now), with each rank's
    slice of the value, :class:`Loaded`. ``initialize`` then materializes them one flat group at a time."""
    world = comm.world_group()
    written = {id(p) for p in modified}
    for item in taken:
        param = item.param
        initial = item.recipe.initial
        if id(param) in written:
            flat = param.detach().reshape(-1)
            chunk = math.ceil(flat.numel() / world.size)
            initial = Loaded(flat[world.rank * chunk : (world.rank + 1) * chunk].clone(), world.size)
        meta = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
        meta.__dict__.update(param.__dict__)  # swap_tensors swaps attributes too: keep the client's
        torch.utils.swap_tensors(param, meta)
        del meta
        item.records.add_pending(param, dataclasses.replace(item.recipe, initial=initial))
        if item.guard is not None:
            item.records.guard_pending(param, item.guard)


def creation_order(param: nn.Parameter) -> Optional[int]:
    """The registration order of a parameter built under zero.Init (the same on every rank), else None."""
    pending = pending_recipe(param)
    return pending.ordinal if pending is not None else None


def release_pending(params: Iterable[nn.Parameter]) -> None:
    """The parameters are sharded (or whole) now: their zero.Init recipes are no longer needed."""
    for param in params:
        records = records_of(param)
        if records is not None and records.pending(param) is not None:
            records.forget(param)
