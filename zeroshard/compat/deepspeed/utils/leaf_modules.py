"""DeepSpeed's `deepspeed.utils` leaf-module calls: marking modules that must each be one stage-3 gather unit (MoE).

DeepSpeed's contract is a flag on the module (``module._z3_leaf``), which clients set before ``initialize`` and
read back with ``z3_leaf_module``; ``deepspeed.initialize`` passes the flagged modules to zeroshard's
``initialize(leaf_modules=...)``, where the gather-unit planner makes each one a unit."""

from __future__ import annotations

from typing import Union

import torch

_FLAG = "_z3_leaf"  # DeepSpeed's attribute name: clients may read it directly


def z3_leaf_module(model: torch.nn.Module) -> bool:
    return bool(getattr(model, _FLAG, False))


def get_z3_leaf_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [module for module in model.modules() if z3_leaf_module(module)]


def set_z3_leaf_module(model: torch.nn.Module, flag: bool) -> None:
    setattr(model, _FLAG, flag)


def _matches(module: torch.nn.Module, wanted: Union[type, str]) -> bool:
    if isinstance(wanted, type):
        return isinstance(module, wanted)
    cls = type(module)
    return wanted in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")


def _set_by_class(model, leaf_module_classes, flag: bool, raise_if_not_found: bool) -> list[torch.nn.Module]:
    if not all(isinstance(c, (type, str)) for c in leaf_module_classes):
        raise TypeError(f"leaf_module_classes must be classes or class names, got {leaf_module_classes!r}")
    found = [m for m in model.modules() if any(_matches(m, c) for c in leaf_module_classes)]
    if not found and raise_if_not_found:
        raise ValueError(f"no module of {type(model).__name__} is of class {list(leaf_module_classes)}")
    for module in found:
        set_z3_leaf_module(module, flag)
    return found


def set_z3_leaf_modules(model, leaf_module_classes, raise_if_not_found: bool = True) -> list[torch.nn.Module]:
    return _set_by_class(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model, leaf_module_classes, raise_if_not_found: bool = True) -> list[torch.nn.Module]:
    return _set_by_class(model, leaf_module_classes, False, raise_if_not_found)


def set_z3_leaf_modules_by_name(model, module_names, flag: bool = True, raise_if_not_found: bool = True):
    modules = dict(model.named_modules())
    found = [modules[n] for n in module_names if n in modules]
    missing = [n for n in module_names if n not in modules]
    if missing and raise_if_not_found:
        raise ValueError(f"no modules named {missing} in {type(model).__name__}")
    for module in found:
        set_z3_leaf_module(module, flag)
    return found, missing


def set_z3_leaf_modules_by_suffix(model, module_name_suffixes, flag: bool = True, raise_if_not_found: bool = True):
    named = [(n, m) for n, m in model.named_modules() if n]
    found, missing = [], []
    for suffix in module_name_suffixes:
        hits = [m for n, m in named if n.endswith(suffix)]
        if not hits:
            missing.append(suffix)
        found += [m for m in hits if all(m is not f for f in found)]
    if missing and raise_if_not_found:
        raise ValueError(f"no modules matching suffixes {missing} in {type(model).__name__}")
    for module in found:
        set_z3_leaf_module(module, flag)
    return found, missing


__all__ = [
    "get_z3_leaf_modules",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
]
