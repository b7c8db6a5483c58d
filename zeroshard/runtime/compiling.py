"""``engine.compile()``: each gather unit, or each repeated block, compiled in place with zeroshard's hooks outside.

Note [per-unit compile]: ``torch.compile(model)`` traces the whole forward, and every gather hook inside it ends a
graph (the hooks are ``torch.compiler.disable``: a gather is a collective on a parameter that is still sharded). So
the engine compiles the stretches between its hooks itself: ``nn.Module.compile()`` in place (PyTorch's own, which
DeepSpeed's ``engine.compile`` and Accelerate's regional compile call) on each gather unit that holds no other one,
or at stages 0-2, where no module carries a hook, on each repeated block. ``nn.Module.compile`` leaves the module's
``_call_impl`` eager: the unit's own hooks run before and after its compiled forward (dynamo skips a hook that is
itself ``torch.compiler.disable``: a lambda around one would be traced up to the call and counted as a break), so a
unit is one graph, and identical blocks share it (dynamo reads their parameters as graph inputs). Parameters keep
their names (no ``_orig_mod.``): compiled and eager runs read and write the same checkpoints.

Dynamo counts graphs and breaks per process; :meth:`CompiledRegions.observed` counts them while one engine's
forward and backward run, so each engine reports its own.
"""

from __future__ import annotations

import contextlib
import inspect
from collections import Counter
from typing import Any, Callable, Collection, Iterator, Optional, Union

import torch
import torch.nn as nn

from ..config.schema import CompileConfig
from ..log import log_rank0, logger
from ..zero.stage3.units import repeated_block_classes, runs

Backend = Union[str, Callable]


def choose_regions(root: nn.Module, hooked: Collection[nn.Module]) -> list[str]:
    """Paths of the modules to compile in place, pre-order: the outermost repeated blocks and ``hooked`` modules
    (those that gather a unit) that hold no ``hooked`` module below them; when there are none, the root itself if it
    holds none (a model without repeated blocks at stages 0-2, or one gather unit). Pure: no compiling."""
    blocks = repeated_block_classes(root, any_parent=True)  # a PipelineModule's layers too
    hooked_ids = {id(m) for m in hooked}
    paths = dict(root.named_modules(remove_duplicate=False))
    holders = {  # every module with a hooked module strictly below it
        path[:cut]
        for path, module in paths.items()
        if path and id(module) in hooked_ids
        for cut in [0, *(i for i, ch in enumerate(path) if ch == ".")]
    }
    chosen: list[str] = []
    for path, module in paths.items():
        if not path or path in holders or not runs(module) or any(path.startswith(c + ".") for c in chosen):
            continue
        if type(module).__name__ in blocks or id(module) in hooked_ids:
            chosen.append(path)
    if not chosen and "" not in holders:
        return [""]
    return chosen


def compile_options(backend: Optional[Backend], kwargs: Optional[dict], config_backend: str, config_kwargs: dict):
    """The backend and ``torch.compile`` keywords one ``engine.compile`` call uses: its own, else the config's
    ``compile`` block's. Checked before anything is compiled: an unknown backend or keyword is a ``ValueError`` /
    ``TypeError`` naming it."""
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"engine.compile(compile_kwargs=...) takes a dict, not {type(kwargs).__name__}")
    options = {**config_kwargs, **(kwargs or {})}
    if "backend" in options:  # as DeepSpeed: the argument decides
        logger.warning("engine.compile(): 'backend' in compile_kwargs is overridden by the backend argument")
        options.pop("backend")
    backend = backend or config_backend
    if isinstance(backend, str):
        known = torch._dynamo.list_backends(exclude_tags=())
        if backend not in known:
            raise ValueError(f"engine.compile(backend={backend!r}): not a torch.compile backend; known: {known}")
    elif not callable(backend):
        raise TypeError(f"engine.compile(backend={backend!r}): a backend is a name ('inductor') or a callable")
    accepted = set(inspect.signature(torch.compile).parameters) - {"model", "backend"}
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise TypeError(
            f"engine.compile(): {unknown} are not torch.compile options (compile_kwargs / the config's "
            f"compile.kwargs); it takes {sorted(accepted)}"
        )
    return backend, options


class CompiledRegions:
    """The modules one engine compiled in place, and what dynamo did for them while the engine ran: graphs compiled
    (a recompile is one more) and graph breaks by reason (each new reason is logged once)."""

    def __init__(self, root: nn.Module, paths: list[str], backend: Backend, options: dict[str, Any]):
        self.paths = paths
        for path in paths:
            root.get_submodule(path).compile(backend=backend, **options)
        self.graphs = 0
        self.breaks: Counter[str] = Counter()
        self._graphs_reported = 0
        log_rank0(f"engine.compile(): {describe(root, paths)} compiled in place with {_name(backend)}")

    @contextlib.contextmanager
    def observed(self) -> Iterator[None]:
        """Count what dynamo compiles and breaks while this engine's forward or backward runs."""
        from torch._dynamo.utils import counters

        graphs, breaks = counters["stats"]["unique_graphs"], dict(counters["graph_break"])
        try:
            yield
        finally:
            self.graphs += counters["stats"]["unique_graphs"] - graphs
            for reason, count in counters["graph_break"].items():
                if count > breaks.get(reason, 0):
                    if reason not in self.breaks:
                        logger.warning("engine.compile(): a graph break inside a compiled region: %s", _gist(reason))
                    self.breaks[reason] += count - breaks.get(reason, 0)

    def report(self) -> str:
        """The step report's line: graphs compiled so far and since the last report, graph breaks."""
        since, self._graphs_reported = self.graphs - self._graphs_reported, self.graphs
        return (
            f"compiled: {len(self.paths)} regions, {self.graphs} graphs ({since} since the last report), "
            f"{sum(self.breaks.values())} graph breaks"
        )


def compile_regions(
    root: nn.Module,
    hooked: Collection[nn.Module],
    block: CompileConfig,
    backend: Optional[Backend],
    compile_kwargs: Optional[dict],
    schedule: Any,
    compiled_autograd_enabled: bool,
) -> Optional[CompiledRegions]:
    """What ``engine.compile(...)`` does (its arguments, DeepSpeed 0.19's; ``block``: the config's ``compile``):
    the regions :func:`choose_regions` picks, compiled in place; ``None`` when ``compile.disable`` is set."""
    if schedule is not None:
        raise NotImplementedError(
            "engine.compile(schedule=...): DeepCompile's pass schedules are not implemented; zeroshard's gathers, "
            "prefetches and reductions run between the compiled units (leave schedule unset)"
        )
    if block.disable:
        logger.warning("engine.compile(): the config's compile.disable is true; the module stays uncompiled")
        return None
    backend, options = compile_options(backend, compile_kwargs, block.backend, block.kwargs)
    if compiled_autograd_enabled:
        logger.warning(
            "engine.compile(compiled_autograd_enabled=True) is not honoured: zeroshard's gradient hooks launch "
            "reductions (and at stage 3 gathers) during backward, which compiled autograd would trace; each "
            "compiled region's backward runs as its own compiled graph"
        )
    if block.deepcompile:
        log_rank0(
            "compile.deepcompile: each gather unit is compiled with its gathers, prefetches and reductions outside "
            "the graph, where zeroshard's hooks run them (DeepCompile's ZeRO passes insert them into one graph)"
        )
    return CompiledRegions(root, choose_regions(root, hooked), backend, options)


def describe(root: nn.Module, paths: list[str]) -> str:
    """``4 x Block (blocks.0 .. blocks.3)``: the regions by class."""
    by_class: dict[str, list[str]] = {}
    for path in paths:
        by_class.setdefault(type(root.get_submodule(path)).__name__, []).append(path or "<root>")
    return ", ".join(
        f"{len(p)} x {name} ({p[0]}{' .. ' + p[-1] if len(p) > 1 else ''})" for name, p in by_class.items()
    )


def _name(backend: Backend) -> str:
    return backend if isinstance(backend, str) else getattr(backend, "__name__", type(backend).__name__)


def _gist(reason: str) -> str:
    """A dynamo break reason's first two lines (the rest is hints and links)."""
    return " | ".join(line.strip() for line in reason.strip().splitlines()[:2])
