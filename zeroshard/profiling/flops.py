"""A per-module flops profile of a model's forward, on torch's flop counter (DeepSpeed's flops profiler API).

``torch.utils.flop_counter.FlopCounterMode`` counts the floating-point operations of the matrix products (linear
layers, matmuls, convolutions, attention) from the shapes each operator sees at run time, 2 per multiply-add
(a linear layer on ``n`` rows: ``2·n·in·out``). Forward pre- and post-hooks on every module read the running
total around each call, so each module's count includes its children's and sums over every time it runs. Since
the counter reads shapes at run time, a ZeRO-3 model counts its full parameters (they are gathered during
forward), and parameter counts use full shapes too. Elementwise operations (activations, norms, softmax) are not
counted: in a transformer they are well under 1% of the total. MACs are half the flops.
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

HEADER = "zeroshard flops profile"  # first line of every profile written to a file


def _cpu_attention_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:
    """Scaled dot-product attention's CPU kernel, which torch's counter leaves out: its two matrix products, as
    for the GPU kernels (the arguments arrive as shapes)."""
    return sdpa_flop_count(query, key, value)


# operators torch's counter does not know, with their formulas
_EXTRA_FORMULAS = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention_flops}


@dataclass
class ModuleStats:
    flops: int = 0
    duration: float = 0.0  # seconds, summed over calls
    calls: int = 0


class FlopsProfiler:
    """Profiles ``model``'s forward between :meth:`start_profile` and :meth:`stop_profile`.

    ``recompute_fwd_factor``: the share of the forward that activation checkpointing runs again in backward
    (0 without it, 1 when every layer is recomputed), used for the forward+backward estimate (backward costs
    twice the forward)."""

    def __init__(self, model: nn.Module, ds_engine: Any = None, recompute_fwd_factor: float = 0.0):
        if not isinstance(model, nn.Module):
            raise TypeError(f"FlopsProfiler profiles an nn.Module, got {type(model).__name__}")
        if not (isinstance(recompute_fwd_factor, (int, float)) and 0.0 <= recompute_fwd_factor <= 1.0):
            raise ValueError(f"recompute_fwd_factor must be in [0, 1], got {recompute_fwd_factor!r}")
        self.model = model
        self.recompute_fwd_factor = float(recompute_fwd_factor)
        self.stats: dict[str, ModuleStats] = {}
        self._counter: Optional[FlopCounterMode] = None
        self._handles: list = []
        self._open: dict[int, list[tuple[int, float]]] = {}  # id(module) -> (flops, time) at each open call
        self._started: Optional[float] = None
        self.duration = 0.0  # the profiled forward's seconds
        self.started = False

    # -- collecting -----------------------------------------------------------------------------------
    def start_profile(self, ignore_list: Optional[list[type]] = None) -> None:
        """Count from now on; modules of the classes in ``ignore_list`` get no line of their own (their flops
        still count toward their parents)."""
        self.reset_profile()
        ignored = tuple(ignore_list or ())
        for path, module in self.model.named_modules():
            if ignored and isinstance(module, ignored):
                continue
            self._handles.append(module.register_forward_pre_hook(self._pre))
            self._handles.append(module.register_forward_hook(self._make_post(path)))
        self._counter = FlopCounterMode(display=False, custom_mapping=_EXTRA_FORMULAS)
        self._counter.__enter__()
        self._started = time.perf_counter()
        self.started = True

    def _pre(self, module: nn.Module, args) -> None:
        self._open.setdefault(id(module), []).append((self._counter.get_total_flops(), time.perf_counter()))

    def _make_post(self, path: str) -> Callable:
        def post(module: nn.Module, args, output) -> None:
            flops, started = self._open[id(module)].pop()
            stats = self.stats.setdefault(path, ModuleStats())
            stats.flops += self._counter.get_total_flops() - flops
            stats.duration += time.perf_counter() - started
            stats.calls += 1

        return post

    def stop_profile(self) -> None:
        """Stop counting; what was counted stays readable until :meth:`end_profile`."""
        if self._counter is not None:
            self.duration += time.perf_counter() - self._started
            self._counter.__exit__(None, None, None)
            self._counter = None
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._open.clear()

    def reset_profile(self) -> None:
        self.stop_profile()
        self.stats.clear()
        self.duration = 0.0

    def end_profile(self) -> None:
        self.reset_profile()
        self.started = False

    # -- totals (DeepSpeed's getters) ------------------------------------------------------------------
    def get_total_flops(self, as_string: bool = False):
        flops = self.stats[""].flops if "" in self.stats else 0
        return number_to_string(flops, "FLOPs") if as_string else flops

    def get_total_macs(self, as_string: bool = False):
        macs = self.get_total_flops() // 2
        return number_to_string(macs, "MACs") if as_string else macs

    def get_total_params(self, as_string: bool = False):
        params = _params(self.model)
        return number_to_string(params, "") if as_string else params

    def get_total_duration(self, as_string: bool = False):
        return duration_to_string(self.duration) if as_string else self.duration

    # -- reports -----------------------------------------------------------------------------------------
    def print_model_profile(
        self,
        profile_step: int = 1,
        module_depth: int = -1,
        top_modules: int = 1,
        detailed: bool = True,
        output_file: Optional[str] = None,
        step_duration: Optional[float] = None,
    ) -> None:
        """The totals, the ``top_modules`` modules by flops at each depth up to ``module_depth`` (-1: every
        depth), and with ``detailed`` the module tree to that depth, to stdout or to ``output_file`` (never
        over a file that is not an earlier profile)."""
        _check_depths(module_depth, top_modules)
        lines = [HEADER, f"profile step: {profile_step}"]
        fwd = self.get_total_flops()
        lines += [
            f"parameters: {number_to_string(self.get_total_params(), '')}",
            f"forward MACs: {number_to_string(fwd // 2, 'MACs')}",
            f"forward FLOPs: {number_to_string(fwd, 'FLOPs')}",
            f"backward FLOPs (2 x forward): {number_to_string(2 * fwd, 'FLOPs')}",
            f"forward + backward FLOPs (x{3 + self.recompute_fwd_factor:g}): "
            f"{number_to_string(int(fwd * (3 + self.recompute_fwd_factor)), 'FLOPs')}",
            f"forward latency: {duration_to_string(self.duration)}",
            f"forward FLOPS: {number_to_string(fwd / self.duration if self.duration else 0, 'FLOPS')}",
        ]
        if step_duration:
            total = fwd * (3 + self.recompute_fwd_factor)
            lines += [
                f"iteration latency: {duration_to_string(step_duration)}",
                f"iteration FLOPS: {number_to_string(total / step_duration, 'FLOPS')}",
            ]
        lines += ["", f"top {top_modules} module(s) by FLOPs at each depth:"]
        lines += self._aggregated(module_depth, top_modules)
        if detailed:
            lines += ["", "per module: parameters, MACs, FLOPs (share of the total), latency, calls"]
            lines += self._tree(module_depth)
        _emit("\n".join(lines) + "\n", output_file)

    def print_model_aggregated_profile(self, module_depth: int = -1, top_modules: int = 1) -> None:
        _check_depths(module_depth, top_modules)
        _emit("\n".join(self._aggregated(module_depth, top_modules)) + "\n", None)

    def _per_module(self) -> dict[str, ModuleStats]:
        """Every module's stats; a container that is never called itself (``nn.ModuleList``) gets its children's
        sums."""
        totals: dict[str, ModuleStats] = {}
        for path, module in reversed(list(self.model.named_modules())):  # children before parents
            if path in self.stats:
                totals[path] = self.stats[path]
                continue
            children = [totals[f"{path}.{name}" if path else name] for name, _ in module.named_children()]
            totals[path] = ModuleStats(
                sum(c.flops for c in children),
                sum(c.duration for c in children),
                max((c.calls for c in children), default=0),
            )
        return totals

    def _aggregated(self, module_depth: int, top_modules: int) -> list[str]:
        by_depth: dict[int, list[tuple[str, ModuleStats]]] = {}
        for path, stats in self._per_module().items():
            by_depth.setdefault(_depth(path), []).append((path, stats))
        lines = []
        for depth in sorted(by_depth):
            if module_depth != -1 and depth > module_depth:
                break
            top = sorted(by_depth[depth], key=lambda item: -item[1].flops)[:top_modules]
            shown = ", ".join(f"{path or '<model>'} {number_to_string(s.flops, 'FLOPs')}" for path, s in top)
            lines.append(f"  depth {depth}: {shown}")
        return lines

    def _tree(self, module_depth: int) -> list[str]:
        total = max(self.get_total_flops(), 1)
        per_module = self._per_module()
        lines = []
        for path, module in self.model.named_modules():
            depth = _depth(path)
            if module_depth != -1 and depth > module_depth:
                continue
            stats = per_module[path]
            name = path.rsplit(".", 1)[-1] if path else "<model>"
            lines.append(
                f"{'  ' * depth}{name} ({type(module).__name__}): {number_to_string(_params(module), '')} params, "
                f"{number_to_string(stats.flops // 2, 'MACs')}, {number_to_string(stats.flops, 'FLOPs')} "
                f"({100 * stats.flops / total:.2f}%), {duration_to_string(stats.duration)}, {stats.calls} call(s)"
            )
        return lines


def get_model_profile(
    model: nn.Module,
    input_shape: Optional[tuple] = None,
    args: Optional[list] = None,
    kwargs: Optional[dict] = None,
    print_profile: bool = True,
    detailed: bool = True,
    module_depth: int = -1,
    top_modules: int = 1,
    warm_up: int = 1,
    as_string: bool = True,
    output_file: Optional[str] = None,
    ignore_modules: Optional[list[type]] = None,
    mode: str = "forward",
):
    """Run ``model`` once (after ``warm_up`` unprofiled runs) on ``args``/``kwargs``, or on one tensor of
    ``input_shape`` in the model's dtype and device, and return ``(flops, macs, params)`` of that forward
    (``mode="generate"`` profiles ``model.generate``)."""
    if mode not in ("forward", "generate"):
        raise ValueError(f"mode must be 'forward' or 'generate', got {mode!r}")
    if not isinstance(warm_up, int) or isinstance(warm_up, bool) or warm_up < 0:
        raise ValueError(f"warm_up must be an integer >= 0, got {warm_up!r}")
    args, kwargs = list(args or []), dict(kwargs or {})
    if input_shape is not None:
        if args or kwargs:
            raise ValueError("give input_shape or args/kwargs, not both")
        if not (isinstance(input_shape, (tuple, list)) and all(isinstance(d, int) and d > 0 for d in input_shape)):
            raise ValueError(f"input_shape must be a tuple of positive integers, got {input_shape!r}")
        first = next(model.parameters(), None)
        dtype = first.dtype if first is not None else torch.float32
        device = first.device if first is not None else torch.device("cpu")
        args = [torch.ones(tuple(input_shape), dtype=dtype, device=device)]
    run = model.generate if mode == "generate" else model
    with torch.no_grad():
        for _ in range(warm_up):
            run(*args, **kwargs)
        profiler = FlopsProfiler(model)
        profiler.start_profile(ignore_list=ignore_modules)
        run(*args, **kwargs)
        profiler.stop_profile()
    if print_profile:
        profiler.print_model_profile(
            module_depth=module_depth, top_modules=top_modules, detailed=detailed, output_file=output_file
        )
    flops, macs, params = profiler.get_total_flops(), profiler.get_total_macs(), profiler.get_total_params()
    profiler.end_profile()
    if as_string:
        return number_to_string(flops, "FLOPs"), number_to_string(macs, "MACs"), number_to_string(params, "")
    return flops, macs, params


def _params(module: nn.Module) -> int:
    """Full-shape parameter count (a ZeRO-3 parameter answers its full shape while sharded)."""
    return sum(p.numel() for p in module.parameters())


def _depth(path: str) -> int:
    return 0 if not path else path.count(".") + 1


def _check_depths(module_depth: int, top_modules: int) -> None:
    if not isinstance(module_depth, int) or isinstance(module_depth, bool) or module_depth < -1:
        raise ValueError(f"module_depth must be -1 (every depth) or >= 0, got {module_depth!r}")
    if not isinstance(top_modules, int) or isinstance(top_modules, bool) or top_modules < 1:
        raise ValueError(f"top_modules must be an integer >= 1, got {top_modules!r}")


def _emit(text: str, output_file: Optional[str]) -> None:
    if output_file is None:
        print(text, end="", file=sys.stdout)
        return
    _write_profile(os.fspath(output_file), text)


def _write_profile(path: str, text: str) -> None:
    """Write ``text`` to ``path``, replacing only an earlier profile: a mistyped path that names a checkpoint or
    any other file is refused, never overwritten."""
    if not path or "\x00" in path:
        raise ValueError(f"flops profiler output_file {path!r} is not a usable path")
    if os.path.lexists(path):
        if not os.path.isfile(path) or os.path.islink(path):
            raise ValueError(f"flops profiler output_file {path!r} exists and is not a regular file; not written")
        with open(path, "rb") as existing:
            if existing.read(len(HEADER)) != HEADER.encode():
                raise FileExistsError(
                    f"flops profiler output_file {path!r} exists and is not an earlier profile; not overwritten"
                )
    parent = os.path.dirname(path) or "."
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"flops profiler output_file {path!r}: directory {parent!r} does not exist")
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w") as out:
        out.write(text)
    os.replace(temporary, path)


def number_to_string(value: float, unit: str, precision: int = 2) -> str:
    """``1234567`` -> ``'1.23 M<unit>'``."""
    value = float(value)
    magnitude = 0 if value == 0 else min(int(math.log10(abs(value)) // 3), 4)
    magnitude = max(magnitude, 0)
    if magnitude == 0 and value.is_integer():
        return f"{int(value)} {unit}".rstrip()
    prefix = ["", "K", "M", "G", "T"][magnitude]
    return f"{value / 1000**magnitude:.{precision}f} {prefix}{unit}".rstrip()


def duration_to_string(seconds: float, precision: int = 2) -> str:
    if seconds >= 1 or seconds == 0:
        return f"{seconds:.{precision}f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.{precision}f} ms"
    return f"{seconds * 1e6:.{precision}f} us"
