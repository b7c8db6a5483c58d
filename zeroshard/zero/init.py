"""``zero.Init``: build a model without ever holding all of its parameters.

Inside the context a module's parameters are real while its ``__init__`` runs, so whatever that ``__init__``
writes (``nn.Parameter(torch.ones(5))``, ``self.weight.data.fill_(...)``, ``reset_parameters()``) is their value,
exactly as in a build without zero.Init. Once the module's ``__init__`` has returned, its parameters are put
away and become meta tensors; construction holds at most the parameters of the modules still being built.
``zeroshard.initialize`` then materializes them one flat group at a time, just before that group is sharded,
and each rank keeps only its shard. How a value is put away (Note [putting initial values away]):

- **replayed**: the module's ``reset_parameters()``, run from the random-generator state its ``__init__``
  started from, reproduces every one of its parameters bit for bit (checked when it is put away): only that
  generator state is kept (``nn.Linear``, ``nn.Embedding``, ``nn.LayerNorm`` and most torch layers);
- **constant**: every element equal (``torch.ones``, ``torch.zeros``): the number is kept;
- **sharded**: anything else: rank 0's value is broadcast and each rank keeps 1/world of it, gathered back at
  materialization.

Every rank materializes rank 0's values (the replay state is rank 0's too), as DeepSpeed broadcasts them.

Writes after a module's ``__init__`` has returned (a parent's ``self.apply(init)``, Hugging Face's ``post_init``)
reach a meta tensor and are lost, as under DeepSpeed; zeroshard replays them instead: the model's own
``_init_weights`` (Hugging Face's name) or ``param_init_fn`` runs on each module as it is materialized, under a
generator seeded from the Init seed and the module's path, so the result does not depend on the order of
materialization. :func:`reset_parameters` applies the same to a model built normally (for references and tests).

Writing weights before ``initialize`` (how Hugging Face's ``from_pretrained`` loads under ZeRO-3): inside
``GatheredParameters(params, modifier_rank=r)`` a parameter that has no data yet is materialized (its initial
value, as above), the modifier writes it, and at exit rank ``r``'s values are broadcast and kept; ``initialize``
then shards those values instead of initial ones. After the Init context has closed, any other access to a
parameter with no data raises :class:`~zeroshard.zero.ShardedParameterError` naming it: a load that would have
been a silent no-op on a meta tensor is an error.
"""

from __future__ import annotations

import contextlib
import math
import sys
import weakref
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.nn as nn
from torch.nn.modules.module import register_module_parameter_registration_hook

from .. import comm
from ..accelerator import release_host_memory
from ..config import parse_config
from .sharded_param import InitRecipe, ParamRecords, records_of

ParamInitFn = Callable[[nn.Module], None]
_TRIM_BYTES = 1 << 20  # host memory freed by putting a module away that is worth handing back at once
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


@dataclass
class _Building:
    """A module whose ``__init__`` registered parameters, until they are put away."""

    module: weakref.ref
    generator_state: torch.Tensor  # when its first parameter was registered: where its reset_parameters() started
    device: torch.device
    params: list[nn.Parameter] = field(default_factory=list)


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
        config_dtype = None
        if source is not None:
            parsed = parse_config(source)
            if parsed.zero_optimization.stage != 3:
                raise ValueError(
                    f"zero.Init builds stage-3 models, but the config has zero_optimization.stage "
                    f"{parsed.zero_optimization.stage}"
                )
            # as DeepSpeed: the parameters are created in the config's half precision
            config_dtype = torch.bfloat16 if parsed.bf16.enabled else torch.float16 if parsed.fp16.enabled else None
        self.enabled = enabled
        self.dtype = dtype or config_dtype
        self.param_init_fn = param_init_fn
        self.seed = (torch.initial_seed() if seed is None else seed) % 2**63  # fits the int64 broadcast
        # the parameters this context builds, and how to give them values, until initialize shards them
        self.records = ParamRecords()
        self._building: dict[int, _Building] = {}  # id(module) -> its parameters not put away yet, in build order
        self._ordinals: dict[int, int] = {}  # id(param) -> registration order
        self._created: list[tuple[nn.Parameter, str]] = []  # put away, until __exit__ guards them
        self._registration: Optional[contextlib.ExitStack] = None
        self._world: Optional[comm.Group] = None

    def _on_register(self, module: nn.Module, name: str, param: nn.Parameter) -> None:
        if param.is_meta or id(param) in self._ordinals:
            return  # already put away, or registered before on the module that owns it (a tied weight)
        self._put_away(done_only=True)
        if self.dtype is not None and param.is_floating_point() and param.dtype != self.dtype:
            param.data = param.data.to(self.dtype)  # the same object: a reference __init__ holds stays valid
        building = self._building.get(id(module))
        if building is None:
            building = _Building(weakref.ref(module), _generator_state(param.device), param.device)
            self._building[id(module)] = building
        building.params.append(param)
        self._ordinals[id(param)] = len(self._ordinals)

    def _put_away(self, done_only: bool) -> None:
        """Put away the parameters of every module whose ``__init__`` has returned (all of them with not
        ``done_only``), in the order the modules were first seen: the same on every rank, since it issues
        collectives."""
        if not self._building:
            return
        active = _modules_under_construction() if done_only else set()
        for key in [key for key in self._building if key not in active]:
            self._put_away_module(self._building.pop(key))

    def _put_away_module(self, building: _Building) -> None:
        module = building.module()
        if module is None:
            return
        mine = {id(p) for p in building.params}
        # a parameter something already holds weakly was taken while the context was open (``initialize`` inside
        # ``with zero.Init():``, as DeepSpeed's TestDSInitWZinit does): its engine owns it now, real, so it stays
        named = [
            (n, p)
            for n, p in module.named_parameters(recurse=False)
            if id(p) in mine and not p.is_meta and not weakref.getweakrefcount(p)
        ]
        if not named:
            return
        params = [p for _, p in named]
        initials = _initial_values(module, params, building, self._world)
        for (name, param), initial in zip(named, initials):
            meta = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
            meta.__dict__.update(param.__dict__)  # swap_tensors swaps attributes too: keep the client's
            torch.utils.swap_tensors(param, meta)
            recipe = InitRecipe(self.seed, self.param_init_fn, weakref.ref(module), self._ordinals[id(param)], initial)
            self.records.add_pending(param, recipe)
            self._created.append((param, f"{type(module).__name__}.{name}"))
        del meta
        if building.device.type == "cpu" and sum(p.numel() * p.element_size() for p in params) >= _TRIM_BYTES:
            release_host_memory()

    def __enter__(self) -> "Init":
        if self.enabled:
            comm.init_distributed()  # as DeepSpeed's: a plain process (a notebook) gets a one-process group
            self._world = _world()
            self._registration = contextlib.ExitStack()
            self._registration.enter_context(parameters_registered(self._on_register))
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if self._registration is not None:
            self._registration.close()
            self._registration = None
            if exc_type is None:
                self._put_away(done_only=False)
            self._building.clear()
        # construction is over: from here a write to a parameter still without data is an error, not a no-op
        for param, name in self._created:
            if param.is_meta:
                self.records.guard_pending(param, name)
        self._created.clear()


def _modules_under_construction() -> set[int]:
    """ids of the modules whose ``__init__`` is on the call stack now."""
    active = set()
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "__init__" and code.co_argcount:
            owner = frame.f_locals.get(code.co_varnames[0])
            if isinstance(owner, nn.Module):
                active.add(id(owner))
        frame = frame.f_back
    return active


def _generator_state(device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(device.type).get_rng_state(device)


@contextlib.contextmanager
def _generator_at(state: torch.Tensor, device: torch.device) -> Iterator[None]:
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
def _others_kept(module: nn.Module, changing: Iterable[nn.Parameter]) -> Iterator[None]:
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


def _replays(module: nn.Module, params: list[nn.Parameter], building: _Building) -> bool:
    """Whether ``reset_parameters()`` from the generator state the module's ``__init__`` started from reproduces the
    values its ``__init__`` left, bit for bit (the values are restored either way)."""
    if not callable(getattr(module, "reset_parameters", None)):
        return False
    left = [p.detach().clone() for p in params]
    with torch.no_grad(), _others_kept(module, params), _generator_at(building.generator_state, building.device):
        module.reset_parameters()
        same = all(torch.equal(p, value) for p, value in zip(params, left))
        for param, value in zip(params, left):
            param.copy_(value)
    return same


def _constant(value: torch.Tensor) -> Optional[Any]:
    if value.numel() == 0:
        return 0
    first = value.reshape(-1)[0]
    return first.item() if bool((value == first).all()) else None


def _initial_values(module: nn.Module, params: list[nn.Parameter], building: _Building, world: comm.Group) -> list:
    """Note [putting initial values away]: how each parameter of ``module`` keeps the value its ``__init__`` left
    (rank 0's), from the cheapest: replayed, constant, or sharded. The ranks agree on the choice first, so the
    collectives of the sharded ones match."""
    replays = _replays(module, params, building)
    constants = [_constant(p.detach()) for p in params]
    choice = torch.tensor([replays] + [c is not None for c in constants], dtype=torch.int64)
    comm.all_reduce(choice, world, op="min")
    if choice[0]:
        state = building.generator_state.clone()
        comm.broadcast(state, src=0, group=world)
        return [Replayed(state, building.device)] * len(params)
    initials = []
    for param, constant, agreed in zip(params, constants, choice[1:].tolist()):
        if agreed:
            number = torch.tensor([constant], dtype=torch.float64 if param.is_floating_point() else torch.int64)
            comm.broadcast(number, src=0, group=world)
            initials.append(Constant(number.item()))
            continue
        flat = param.detach().reshape(-1).contiguous()
        comm.broadcast(flat.view(torch.uint8), src=0, group=world)
        chunk = math.ceil(flat.numel() / world.size)
        initials.append(Sharded(flat[world.rank * chunk : (world.rank + 1) * chunk].clone(), world.size))
    return initials


def _initial_data(param: nn.Parameter, initial: Any, world: comm.Group) -> torch.Tensor:
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


@contextlib.contextmanager
def parameters_registered(on_register: Callable[[nn.Module, str, nn.Parameter], Optional[nn.Parameter]]):
    """While open, ``on_register(module, name, param)`` sees every parameter a module registers, and may return a
    replacement (through torch's parameter-registration hook: nothing of ``nn.Module`` is patched). Used by
    zero.Init and ``init_empty_weights``."""
    handle = register_module_parameter_registration_hook(on_register)
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def parameters_replaced(replace: Callable[[nn.Module, str, nn.Parameter], nn.Parameter]) -> Iterator[None]:
    """While open, every real parameter a module registers is replaced by ``replace(module, name, param)``:
    ``init_empty_weights`` builds models on the meta device this way."""

    def hook(module: nn.Module, name: str, param: nn.Parameter) -> Optional[nn.Parameter]:
        return None if param.is_meta else replace(module, name, param)

    with parameters_registered(hook):
        yield


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
    waiting = [(p, _pending(p)) for p in module.parameters(recurse=False) if p.is_meta]
    waiting = [(p, recipe) for p, recipe in waiting if recipe is not None and recipe.module() in (module, None)]
    if not waiting:
        return
    params = [p for p, _ in waiting]
    for param, recipe in waiting:
        _give_data(param, _initial_data(param, recipe.initial, world))
    replayed = next((r.initial for _, r in waiting if isinstance(r.initial, Replayed)), None)
    with torch.no_grad(), _others_kept(module, params):
        if replayed is not None:
            with _generator_at(replayed.generator_state, replayed.device):
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
        with torch.no_grad(), _others_kept(module, owned):
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

    def __init__(self, root: nn.Module, device: torch.device, seed: int, source: Any = None):
        self.root = root
        self.device = device
        self.seed = seed
        self.source = source
        self.owners = _canonical_owners(root)
        self.paths = {id(module): path for path, module in root.named_modules()}
        self.world = _world()

    def __call__(self, params) -> None:
        for param in params:
            if not param.is_meta:
                continue
            if self.source is not None:
                self._read(*self.owners[id(param)])
                continue
            pending = _pending(param)
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


def _pending(param: nn.Parameter) -> Optional[InitRecipe]:
    records = records_of(param)
    return records.pending(param) if records is not None else None


def pending_seed(module: nn.Module) -> Optional[int]:
    """The seed recorded by the Init context that built this module's parameters, if any."""
    return next((pending.seed for p in module.parameters() if (pending := _pending(p)) is not None), None)


def materialize_pending(params: Iterable[nn.Parameter], device: torch.device) -> list[nn.Parameter]:
    """Give parameters built under zero.Init that have no data yet their initial values now, before
    ``initialize`` (for writes such as a pretrained-weight load; a collective, like the gather it serves). Returns
    the ones materialized."""
    done = []
    for param in params:
        pending = _pending(param)
        module = pending.module() if pending is not None else None
        if module is None or not param.is_meta:
            continue
        ordinal = min(rec.ordinal for p in module.parameters(recurse=False) if (rec := _pending(p)) is not None)
        _materialize_module(module, f"#{ordinal}", pending.seed, pending.param_init_fn, _world(), device)
        done.append(param)
    return done


def _world() -> comm.Group:
    return comm.Group("world", tuple(range(comm.get_world_size())), None)


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
