"""Loading a Python file that is not in a package (a fixture's ``shapes.py``, a test script) as a module: the
fixtures' writers run it under real DeepSpeed, the tests under zeroshard, so both share one model, data and config."""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType
from typing import Optional


def module_from_file(path: str | os.PathLike, name: Optional[str] = None, register: bool = False) -> ModuleType:
    """The module ``path`` defines, executed once per call. ``register`` puts it in ``sys.modules`` under ``name``
    (so objects defined there pickle by reference, e.g. into spawned ranks)."""
    name = name or f"fixture_{os.path.splitext(os.path.basename(path))[0]}"
    spec = importlib.util.spec_from_file_location(name, os.fspath(path))
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


__all__ = ["module_from_file"]
