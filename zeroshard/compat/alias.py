"""``install_as_deepspeed()``: serve ``import deepspeed`` from zeroshard, the way ``pymysql.install_as_MySQLdb()``
serves Django.

A finder placed first on ``sys.meta_path`` maps ``deepspeed`` and ``deepspeed.<sub>`` to
``zeroshard.compat.deepspeed`` and ``zeroshard.compat.deepspeed.<sub>`` (the very same module objects, so
``deepspeed.zero is zeroshard.compat.deepspeed.zero``), and answers ``importlib.metadata`` for the
distribution ``deepspeed`` with the DeepSpeed release whose API the namespace implements: Hugging Face,
Accelerate and Lightning check that version before they call DeepSpeed.

Three ways in, all the same mechanism: calling :func:`install_as_deepspeed`; the launcher flag
``zeroshard --as_deepspeed`` (which runs the script through :mod:`zeroshard.compat.run`); and the environment
variable ``ZEROSHARD_AS_DEEPSPEED=1`` (or true/yes/on), read at interpreter start by the
``zeroshard-as-deepspeed.pth`` file the package installs (for ``torchrun``, ``accelerate launch``, SLURM).

On a machine without a GPU the same finder adapts Accelerate so that it runs DeepSpeed on CPU ranks
(:mod:`zeroshard.compat.accelerate_cpu`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import os
import pathlib
import sys
import warnings
from typing import Optional

from . import accelerate_cpu

DEEPSPEED_API_VERSION = "0.19.8"  # the DeepSpeed release whose public API zeroshard.compat.deepspeed follows
ENV_FLAG = "ZEROSHARD_AS_DEEPSPEED"
_ALIAS = "deepspeed"
_TARGET = "zeroshard.compat.deepspeed"


def _target_name(fullname: str) -> Optional[str]:
    if fullname == _ALIAS or fullname.startswith(_ALIAS + "."):
        return _TARGET + fullname[len(_ALIAS) :]
    return None


class _Distribution(importlib.metadata.Distribution):
    """Package metadata for ``deepspeed``: its name and the API version; the summary says what it really is."""

    def read_text(self, filename: str) -> Optional[str]:
        if filename in ("METADATA", "PKG-INFO"):
            from zeroshard import __version__

            return (
                "Metadata-Version: 2.1\n"
                f"Name: {_ALIAS}\n"
                f"Version: {DEEPSPEED_API_VERSION}\n"
                f"Summary: zeroshard {__version__} serving DeepSpeed's API (zeroshard.install_as_deepspeed)\n"
            )
        return None

    def locate_file(self, path) -> pathlib.Path:
        return pathlib.Path(__file__).parent / "deepspeed" / path


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        return None  # a placeholder module; exec_module swaps in the real one

    def exec_module(self, module) -> None:
        # the import system returns whatever sys.modules holds under the name once exec_module is done, so the
        # alias and zeroshard's module are one object, and zeroshard's module keeps its own __spec__
        sys.modules[module.__name__] = importlib.import_module(_target_name(module.__name__))

    def get_code(self, fullname):
        """``python -m deepspeed.x`` (runpy): zeroshard's module's code, run as ``__main__``."""
        target = importlib.util.find_spec(_target_name(fullname))
        return target.loader.get_code(target.name)


class _AdaptingLoader(importlib.abc.Loader):
    """Runs a third-party module's own loader, then a zeroshard adapter on the loaded module."""

    def __init__(self, inner, adapt):
        self.inner, self.adapt = inner, adapt

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        self.adapt(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == accelerate_cpu.MODULE and accelerate_cpu.applies():
            return self._adapted(fullname, path, target, accelerate_cpu.adapt)
        name = _target_name(fullname)
        target = importlib.util.find_spec(name) if name is not None else None
        if target is None:
            return None
        return importlib.machinery.ModuleSpec(
            fullname, _Loader(), is_package=target.submodule_search_locations is not None
        )

    def _adapted(self, fullname, path, target, adapt):
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                spec.loader = _AdaptingLoader(spec.loader, adapt)
                return spec
        return None

    def find_distributions(self, context=None):
        name = getattr(context, "name", None)
        if name in (None, _ALIAS):
            yield _Distribution()


def _installed() -> bool:
    return any(isinstance(finder, _Finder) for finder in sys.meta_path)


def install_as_deepspeed() -> None:
    """From now on, in this process, ``import deepspeed`` (and every ``deepspeed.<sub>``) gives zeroshard's
    DeepSpeed-shaped namespace. Idempotent. A real DeepSpeed installation is shadowed (with a one-line
    warning); one already imported cannot be, and is refused."""
    if _installed():
        return
    loaded = sys.modules.get(_ALIAS)
    if loaded is not None:
        raise RuntimeError(
            f"install_as_deepspeed(): a 'deepspeed' module was already imported ({getattr(loaded, '__file__', '?')}); "
            "call it before anything imports deepspeed (or set ZEROSHARD_AS_DEEPSPEED=1 before the process starts)"
        )
    real = importlib.util.find_spec(_ALIAS)
    if real is not None:
        warnings.warn(
            f"zeroshard.install_as_deepspeed(): 'import deepspeed' now gives zeroshard in this process; the installed "
            f"DeepSpeed ({real.origin}) is shadowed",
            stacklevel=2,
        )
    sys.meta_path.insert(0, _Finder())
    importlib.invalidate_caches()


ENABLING = ("1", "true", "yes", "on")
DISABLING = ("", "0", "false", "no", "off")  # the .pth file reads these itself, so a disabled flag imports nothing


def install_from_environment() -> None:
    """Run by the ``.pth`` file at interpreter start: install when ``ZEROSHARD_AS_DEEPSPEED`` is 1/true/yes/on (any
    case); 0/false/no/off or empty leave it off; anything else leaves it off with a warning naming the value."""
    raw = os.environ.get(ENV_FLAG, "")
    value = raw.strip().lower()
    if value in ENABLING:
        install_as_deepspeed()
    elif value not in DISABLING:
        warnings.warn(
            f"{ENV_FLAG}={raw!r} is not a switch zeroshard knows: 'import deepspeed' is NOT served by zeroshard; set "
            f"it to one of {', '.join(ENABLING)} to enable, or {', '.join(v for v in DISABLING if v)} to disable",
            RuntimeWarning,
            stacklevel=2,
        )
