"""Choosing gather units: which modules' parameters are gathered and freed together (pure: no processes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch.nn as nn

DEFAULT_UNIT_MIN_PARAMS = 1_000_000


@dataclass
class UnitPlan:
    name: str  # module path; "" for the root unit
    module: nn.Module
    params: list[nn.Parameter] = field(default_factory=list)


def runs(module: nn.Module) -> bool:
    """Whether calling the module runs code of its own. Containers (``ModuleList``, ``ModuleDict``,
    ``ParameterList``, ...) keep ``nn.Module``'s unimplemented ``forward``: they are never called, so the
    hooks that gather a unit before it runs would never fire for them."""
    return type(module).forward is not nn.Module.forward


def trigger_modules(module: nn.Module) -> list[nn.Module]:
    """The modules whose forward gathers a unit: the unit's module when it runs; for a container (a ``ModuleList``
    made a leaf, as DeepSpeed's ``leaf_module`` allows) the outermost modules inside it that run, each of which
    gathers the whole container's parameters when the data calls it."""
    if runs(module):
        return [module]
    return [found for child in module.children() for found in trigger_modules(child)]


def granularity_leaf_paths(root: nn.Module, threshold: int) -> list[str]:
    """DeepSpeed's ``stage3_module_granularity_threshold``: a module's granularity is the parameters of its subtree
    per module in it (its layers: modules without children that hold parameters, and the modules between them and
    it, containers excepted); the outermost modules whose granularity is at most ``threshold`` become leaf modules,
    each gathered as one unit (many small modules behind one gather). Containers and modules of more than 1e9
    parameters never do; 0 (the default) chooses none."""
    if threshold <= 0:
        return []
    granularity: dict[str, int] = {}

    def visit(module: nn.Module, path: str) -> tuple[int, int]:
        if next(module.parameters(), None) is None:
            return 0, 0
        params = sum(p.numel() for p in module.parameters(recurse=False))
        if next(module.children(), None) is None:
            return 1, params
        layers = 0
        for name, child in module.named_children():
            child_layers, child_params = visit(child, f"{path}.{name}" if path else name)
            layers, params = layers + child_layers, params + child_params
        if not runs(module):
            return layers, params
        layers += 1
        if params <= 1_000_000_000:
            granularity[path] = params // layers
        return layers, params

    visit(root, "")
    chosen: list[str] = []
    for path, _ in root.named_modules():  # pre-order: an outer module is chosen before what it holds
        inside = any(path == leaf or path.startswith(leaf + ".") or leaf == "" for leaf in chosen)
        if not inside and path in granularity and granularity[path] <= threshold:
            chosen.append(path)
    return chosen


def repeated_block_classes(root: nn.Module, any_parent: bool = False) -> frozenset[str]:
    """The classes of the model's repeated blocks: modules that hold modules of their own, run, and appear at least
    twice in one ``ModuleList`` or ``Sequential`` (HF's ``GPT2Block``, ``LlamaDecoderLayer``, our ``Block``); with
    ``any_parent``, twice among the children of any module (a ``PipelineModule`` registers its layers itself).
    Only the outermost such classes: experts repeated inside a repeated decoder layer stay in their layer."""
    repeated: set[str] = set()
    for module in root.modules():
        container = isinstance(module, (nn.ModuleList, nn.Sequential))  # iterated: one block listed twice counts twice
        if any_parent or container:
            held = module if container else module.children()
            names = [type(m).__name__ for m in held if runs(m) and next(m.children(), None) is not None]
            repeated.update(name for name in names if names.count(name) > 1)

    nested = {
        type(inner).__name__
        for outer in root.modules()
        if type(outer).__name__ in repeated
        for inner in outer.modules()
        if inner is not outer
    }
    return frozenset(repeated - nested)


def choose_unit_modules(root: nn.Module, unit_classes: frozenset[str], min_params: int) -> list[str]:
    """Module paths that become units, pre-order. With ``unit_classes`` exactly the modules of those class
    names; otherwise, bottom-up, each module that runs and whose parameters not yet claimed by a unit below
    reach ``min_params`` (the way FSDP's size-based wrap policy works). A container never becomes a unit:
    its parameters and its children's leftovers pass up to the nearest ancestor that runs (or the root)."""
    containers = sorted({type(m).__name__ for m in root.modules() if type(m).__name__ in unit_classes and not runs(m)})
    if containers:
        raise ValueError(
            f"gather_unit_classes names container class(es) {containers}: a container is never called, so its "
            "parameters could never be gathered before use; name the block class it holds instead"
        )
    chosen: set[str] = set()

    def visit(module: nn.Module, path: str) -> int:
        remaining = sum(p.numel() for p in module.parameters(recurse=False))
        for child_name, child in module.named_children():
            remaining += visit(child, f"{path}.{child_name}" if path else child_name)
        if not path:
            return remaining
        is_unit = type(module).__name__ in unit_classes if unit_classes else remaining >= min_params and runs(module)
        if is_unit:
            chosen.add(path)
            return 0
        return remaining

    visit(root, "")
    return [name for name, _ in root.named_modules() if name in chosen]


def leaf_module_paths(root: nn.Module, classes=(), names=(), name_suffixes=()) -> list[str]:
    """Paths of the modules that must each be one gather unit (DeepSpeed's "leaf modules", set for MoE blocks
    whose experts run in an order that changes with the data): modules whose class name or qualified class name
    is in ``classes``, whose path is in ``names``, or whose path ends with one of ``name_suffixes``. An entry that
    matches nothing is an error naming it (a misspelt class would silently change nothing). The root itself may be
    a leaf (path ``""``, as DeepSpeed's tests flag whole models): then the model is one unit, gathered whole. A
    container (``ModuleList``) may be a leaf: its parameters are one unit, gathered when any module inside it runs
    (:func:`trigger_modules`)."""
    modules = dict(root.named_modules())

    def of_class(name: str) -> list[str]:
        return [
            p for p, m in modules.items() if name in (type(m).__name__, f"{type(m).__module__}.{type(m).__qualname__}")
        ]

    hits = {
        **{c: of_class(c) for c in classes},
        **{n: [n] if n in modules else [] for n in names},
        **{x: [p for p in modules if p.endswith(x)] for x in name_suffixes},
    }
    missing = [entry for entry, paths in hits.items() if not paths]
    if missing:
        raise ValueError(f"leaf modules {missing} match no module of {type(root).__name__}")
    matched = {path for paths in hits.values() for path in paths}
    idle = sorted(p for p in matched if not trigger_modules(modules[p]))
    if idle:
        raise ValueError(
            f"leaf modules {idle} are containers with no module inside that runs (a ParameterList?): their "
            "parameters could never be gathered before use; name the module that uses them"
        )
    return [path for path in modules if path in matched]


def plan_units(
    root: nn.Module,
    unit_classes: frozenset[str] = frozenset(),
    min_params: Optional[int] = None,
    leaf_paths: tuple[str, ...] = (),
) -> list[UnitPlan]:
    """The root unit first, then the chosen units in pre-order; each parameter in exactly one unit.

    Which modules: those of ``unit_classes``; else, with ``min_params`` given, by size (``choose_unit_modules``);
    else the model's repeated blocks (``repeated_block_classes``), or by size at ``DEFAULT_UNIT_MIN_PARAMS``
    when it repeats none. Each of ``leaf_paths`` (``leaf_module_paths``) is a unit too, and no unit is chosen
    inside one: all of a leaf's parameters are gathered when it runs, whichever of its children the data uses.

    A parameter belongs to the innermost unit enclosing the module that registers it; a parameter
    registered in two different units (tied weights across units) goes to the root unit, which stays
    gathered from the start of forward to the end of backward.
    """
    if not unit_classes and min_params is None:
        unit_classes = repeated_block_classes(root)
    chosen = choose_unit_modules(root, unit_classes, min_params or DEFAULT_UNIT_MIN_PARAMS)
    inside_a_leaf = {n for n in chosen for leaf in leaf_paths if leaf == "" or n.startswith(leaf + ".")}
    names = [n for n, _ in root.named_modules() if n and n in (set(chosen) - inside_a_leaf) | set(leaf_paths)]
    modules = dict(root.named_modules())
    units = {"": UnitPlan("", root)} | {n: UnitPlan(n, modules[n]) for n in names}
    owner: dict[nn.Parameter, str] = {}
    for param_name, param in root.named_parameters(remove_duplicate=False):
        module_path = param_name.rpartition(".")[0]
        unit = next(
            (n for n in sorted(names, key=len, reverse=True) if module_path == n or module_path.startswith(n + ".")), ""
        )
        owner[param] = unit if owner.get(param, unit) == unit else ""
    for param, unit in owner.items():
        units[unit].params.append(param)
    return [u for u in units.values() if u.params or u.name == ""]
