"""The public API, frozen: names and signatures of what ``zeroshard``, ``zeroshard.zero``, ``zeroshard.comm``,
``zeroshard.checkpoint`` and ``zeroshard.ops.adam`` export. A change to it fails here until the snapshot is
regenerated on purpose::

    python tests/unit/test_api_surface.py --update
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import sys
from pathlib import Path

SNAPSHOT = Path(__file__).with_name("api_surface.json")
MODULES = ["zeroshard", "zeroshard.zero", "zeroshard.comm", "zeroshard.checkpoint", "zeroshard.ops.adam"]


def _signature(obj) -> str:
    try:
        text = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"
    return re.sub(r" at 0x[0-9a-f]+", "", text)  # default values' reprs name their address


def _class_surface(cls: type) -> dict[str, str]:
    """Constructor and the public methods and properties the class itself defines (inherited torch API excluded)."""
    members = {"__init__": _signature(cls)}
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(value, property):
            members[name] = "property"
        elif isinstance(value, (staticmethod, classmethod)):
            members[name] = _signature(value.__func__)
        elif inspect.isfunction(value) and value.__qualname__.startswith(cls.__qualname__ + "."):
            # defined in the class body (torch.optim patches a wrapped ``step`` onto classes it instantiates)
            members[name] = _signature(value)
    return members


def _describe(obj):
    if inspect.ismodule(obj):
        return "module"
    if inspect.isclass(obj):
        return {"class": _class_surface(obj)}
    if callable(obj):
        return _signature(obj)
    return type(obj).__name__


def current_surface() -> dict:
    surface = {}
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        names = getattr(module, "__all__", None) or [
            n
            for n, v in vars(module).items()
            if not n.startswith("_") and getattr(v, "__module__", None) == module_name
        ]
        surface[module_name] = {name: _describe(getattr(module, name)) for name in sorted(names)}
    return surface


def test_public_api_matches_the_snapshot():
    expected = json.loads(SNAPSHOT.read_text())
    actual = current_surface()
    changes = []
    for module in MODULES:
        mine, saved = actual[module], expected.get(module, {})
        changes += [f"{module}.{n}: added" for n in sorted(set(mine) - set(saved))]
        changes += [f"{module}.{n}: removed" for n in sorted(set(saved) - set(mine))]
        changes += [
            f"{module}.{n}: {saved[n]} -> {mine[n]}" for n in sorted(set(mine) & set(saved)) if mine[n] != saved[n]
        ]
    assert not changes, (
        "the public API changed (if on purpose, run `python tests/unit/test_api_surface.py --update` and say so "
        "in the commit):\n  " + "\n  ".join(changes)
    )


if __name__ == "__main__" and "--update" in sys.argv:
    SNAPSHOT.write_text(json.dumps(current_surface(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {SNAPSHOT}")
