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
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn as nn
from torch.nn.modules.module import register_module_parameter_registration_hook

from .. import comm
from ..accelerator import bound_host_heap, release_host_memory
from ..config import parse_config
from .materialize import (
    Constant,
    ParamInitFn,
    Replayed,
    Sharded,
    generator_at,
    others_kept,
)
from .sharded_param import InitRecipe, ParamRecords

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
        if remote_device not in (None, "cpu", "none", "nvme"):
            raise ValueError(f"zero.Init(remote_device={remote_device!r}): expected None, 'none', 'cpu' or 'nvme'")
        source = config_dict_or_path if config_dict_or_path is not None else config
        config_dtype = None
        param_device = None  # the config's offload_param.device
        if source is not None:
            parsed = parse_config(source)
            if parsed.zero_optimization.stage != 3:
                raise ValueError(
                    f"zero.Init builds stage-3 models, but the config has zero_optimization.stage "
                    f"{parsed.zero_optimization.stage}"
                )
            # as DeepSpeed: the parameters are created in the config's half precision
            config_dtype = torch.bfloat16 if parsed.bf16.enabled else torch.float16 if parsed.fp16.enabled else None
            offload = parsed.zero_optimization.offload_param
            param_device = offload.device.value if offload is not None else None
        # as DeepSpeed: the config's offload_param.device, when it has one, overrides remote_device
        device = param_device if param_device is not None else remote_device
        if device == "nvme" and param_device is None:
            raise ValueError(
                "zero.Init(remote_device='nvme') needs config_dict_or_path with zero_optimization.offload_param "
                "{'device': 'nvme', 'nvme_path': ...} (DeepSpeed asserts the same): initialize puts the shards there"
            )
        # Nothing is held before initialize whatever the device (values are put away, not placed; initialize
        # places each shard where the config says); NVMe bounds the host heap from here, before construction grows
        # it (see bound_host_heap)
        self.bounds_heap = device == "nvme"
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
        # the ranks agreeing on initial values: the world of a registration's mesh (mpu=), else every rank on entry
        mesh = getattr(deepspeed_args.get("mpu"), "mesh", None)
        self._world: Optional[comm.Group] = mesh.world if isinstance(mesh, comm.Mesh) else None

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
            if self.bounds_heap:
                bound_host_heap()
            comm.init_distributed()  # as DeepSpeed's: a plain process (a notebook) gets a one-process group
            self._world = self._world or comm.world_group()
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


def _replays(module: nn.Module, params: list[nn.Parameter], building: _Building) -> bool:
    """Whether ``reset_parameters()`` from the generator state the module's ``__init__`` started from reproduces the
    values its ``__init__`` left, bit for bit (the values are restored either way)."""
    if not callable(getattr(module, "reset_parameters", None)):
        return False
    left = [p.detach().clone() for p in params]
    with torch.no_grad(), others_kept(module, params), generator_at(building.generator_state, building.device):
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
