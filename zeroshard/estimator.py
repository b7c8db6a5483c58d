"""``zeroshard.estimate``: the per-rank peak memory of a training run, before running it.

DeepSpeed's estimator counts model states only (users report it off by up to 10x). This one predicts the whole
peak, from the same planning code the engine runs: the resolved config (``zeroshard.config``), the flat-group
and gather-unit plan (``zeroshard.zero.planning``, ``zeroshard.zero.stage3``), the precision policy and the
offload plan; the byte rules follow the objects that hold the memory (``FlatGroup``, ``GradBucket``, the
optimizer-state homes, ``ReusableBuffers``). The model is built on the meta device (no memory), and one
forward on meta tensors measures the activations autograd keeps for backward for the given micro-batch.

Per rank, in bytes and by location (``device``: the accelerator, or the compute side on a CPU-only machine;
``host``: offloaded to CPU memory; ``nvme``):

- ``parameters``: the compute-precision parameters a rank holds between steps (whole below stage 3, its shard
  under stage 3), plus parameters outside any flat group;
- ``gradients``: the reduced gradient shard (fp32 below stage 3, the compute dtype under it);
- ``optimizer_state``: fp32 master weights (unless they are the fp32 parameters themselves) and the optimizer's
  per-element state (counted by stepping the configured optimizer once on one element);
- ``gathered_units`` (stage 3): the root unit, the running unit and the prefetched ones;
- ``communication_buffers``: gradient staging (one bucket staging, one in flight) and, on Gloo, the chunks the
  reduction in flight receives;
- ``activations``: what forward keeps for backward (traced), backward's first working set (the gradients of the
  largest saved tensor and of its input, and the largest parameter's fresh gradient), and under activation
  checkpointing one block's recomputation;
- ``runtime``: a training process without its model (CPU: torch, zeroshard, a Gloo group and one training step
  of a tiny model, probed once in a child process; 0 on GPU, where ``max_memory_allocated`` is compared);
- ``allocator``: freed memory glibc keeps resident on a CPU run (``allocator_retention``).
"""

from __future__ import annotations

import copy
import functools
import importlib
import json
import os
import platform
import re
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch
import torch.nn as nn

CATEGORIES = (
    "runtime",
    "parameters",
    "gradients",
    "optimizer_state",
    "gathered_units",
    "communication_buffers",
    "activations",
    "allocator",
)
LOCATIONS = ("device", "host", "nvme")


@dataclass
class MemoryEstimate:
    """One rank's predicted memory: ``bytes[category][location]``; ``peak`` sums the device (or, on a CPU-only
    machine, the whole process) side."""

    world_size: int
    stage: int
    micro_batch: int
    params: int
    bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def total(self, location: str) -> int:
        return sum(self.bytes[c][location] for c in CATEGORIES)

    @property
    def peak(self) -> int:
        """The predicted peak of the quantity a run is judged by: process RSS on CPU (device + host are one
        memory), device memory on GPU."""
        return self.total("device") + (self.total("host") if _cpu_only() else 0)

    def table(self) -> str:
        lines = [
            f"zeroshard estimate: {self.params / 1e6:.1f}M parameters, ZeRO stage {self.stage}, "
            f"{self.world_size} rank(s), micro-batch {self.micro_batch}; per rank, MiB",
            f"{'category':<24}" + "".join(f"{where:>12}" for where in LOCATIONS),
        ]
        for category in CATEGORIES:
            row = self.bytes[category]
            lines.append(f"{category:<24}" + "".join(f"{row[w] / 2**20:>12.1f}" for w in LOCATIONS))
        lines.append(f"{'total':<24}" + "".join(f"{self.total(w) / 2**20:>12.1f}" for w in LOCATIONS))
        what = "process RSS (CPU run)" if _cpu_only() else "device memory"
        lines.append(f"predicted peak {what}: {self.peak / 2**20:.1f} MiB")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _cpu_only() -> bool:
    from .accelerator import get_accelerator

    return get_accelerator().name == "cpu"


def estimate(
    model_or_factory: Union[nn.Module, Callable[[], nn.Module]],
    config: Any,
    world_size: int,
    sample_inputs: Any = None,
    *,
    runtime_bytes: Optional[int] = None,
) -> MemoryEstimate:
    """Predict one rank's memory for training ``model_or_factory`` with ``config`` on ``world_size`` ranks.

    ``model_or_factory``: a module (it is not modified: a meta copy is planned) or a zero-argument callable
    building one (called under the meta device, so nothing is allocated). ``sample_inputs``: one rank's
    micro-batch as the model's forward takes it (a tuple of positional arguments, a dict of keyword
    arguments, or one tensor), on any device; it may be meta tensors. Without it activations are not counted.
    ``runtime_bytes`` replaces the probed memory of a training process without its model (``runtime_baseline``),
    e.g. with the resident memory of the caller's own warmed-up process."""
    from .config import AutoContext, model_hidden_size, parse_config, resolve_config
    from .offload import OffloadPlan
    from .precision import PrecisionPolicy

    model = _meta_model(model_or_factory)
    parsed = parse_config(config)
    hpz = parsed.zero_optimization.shard_group_size or world_size
    resolution = resolve_config(
        parsed,
        AutoContext(world_size=world_size, args=None, dataloader_batch_size=None, hidden_size=model_hidden_size(model)),
    )
    cfg = resolution.config
    z = cfg.zero_optimization
    policy = PrecisionPolicy.from_config(cfg)
    offload = OffloadPlan.from_config(z, cfg.aio, 0, can_pin=False)
    model = model.to(policy.compute)
    result = MemoryEstimate(
        world_size=world_size,
        stage=z.stage,
        micro_batch=resolution.batch.micro_batch_size,
        params=sum(p.numel() for p in model.parameters()),
        bytes={c: dict.fromkeys(LOCATIONS, 0) for c in CATEGORIES},
    )
    plan = _Plan(model, cfg, policy, offload, shard_count=hpz if z.stage >= 1 else 1)
    plan.count_model_state(result)
    plan.count_buffers(result, gloo=_cpu_only())
    plan.count_compression(result)
    largest_grad = max((p.numel() for p in model.parameters() if p.requires_grad), default=0) * _size(policy.compute)
    largest_transient = largest_grad
    if sample_inputs is not None:
        traced = _trace_activations(model, sample_inputs)
        # backward's first working set: the gradient of the largest saved tensor (the logits, in a language model)
        # and of its input, while the largest parameter's fresh gradient waits to be staged
        working = 2 * traced.largest_saved + largest_grad
        result.bytes["activations"]["device"] = traced.saved + traced.recompute + working
        largest_transient = max(largest_transient, traced.largest_saved)
    else:
        result.notes.append("no sample_inputs: activations not counted")
    result.bytes["runtime"]["device"] = sum(runtime_baseline()) if runtime_bytes is None else runtime_bytes
    result.bytes["allocator"]["device"] = allocator_retention(largest_transient)
    return result


def _meta_model(model_or_factory) -> nn.Module:
    if isinstance(model_or_factory, nn.Module):
        import copy

        with torch.device("meta"):
            return copy.deepcopy(model_or_factory).to("meta")
    with torch.device("meta"):
        model = model_or_factory()
    if not isinstance(model, nn.Module):
        raise TypeError(f"the model factory returned {type(model).__name__}, not an nn.Module")
    return model.to("meta")


class _Plan:
    """The engine's flat-group plan for one rank, on a meta model."""

    def __init__(self, model: nn.Module, cfg, policy, offload, shard_count: int):
        from .zero.planning import StagePolicy, plan_flat_groups, plan_frozen_groups, plan_layouts
        from .zero.stage3 import plan_units

        z = cfg.zero_optimization
        self.cfg, self.policy, self.offload = cfg, policy, offload
        self.stage = StagePolicy.for_stage(z.stage)
        groups = [{"params": [p for p in model.parameters() if p.requires_grad]}]
        units, persistent = [], frozenset()
        unit_of: dict[nn.Parameter, int] = {}
        if self.stage.partition_params:
            unit_plans = plan_units(model, frozenset(z.gather_unit_classes), z.gather_unit_min_params)
            units = [u.params for u in unit_plans]
            unit_of = {p: i for i, u in enumerate(unit_plans) for p in u.params}
            persistent = frozenset(p for p in model.parameters() if p.numel() < z.param_persistence_threshold)
        names = {p: n for n, p in model.named_parameters()}
        self.plans = plan_flat_groups(groups, self.stage, z.reduce_bucket_size, units, persistent)
        self.frozen_plans = plan_frozen_groups(units, persistent) if self.stage.partition_params else []
        count = shard_count if self.stage.partition_optimizer else 1
        self.shard_count = count
        self.layouts = plan_layouts(self.plans, names, count)
        self.frozen_layouts = plan_layouts(self.frozen_plans, names, count)
        # gathered elements per unit (index 0: the root), trainable and frozen flat groups together
        self.unit_numel: dict[int, int] = {}
        for plan, layout in zip(self.plans + self.frozen_plans, self.layouts + self.frozen_layouts):
            if not plan.resident:
                index = unit_of[plan.params[0]]
                self.unit_numel[index] = self.unit_numel.get(index, 0) + layout.padded_numel
        in_flats = {p for plan in self.plans + self.frozen_plans for p in plan.params}
        self.outside = sum(p.numel() for p in model.parameters() if p not in in_flats)
        self.state_tensors = _optimizer_state_tensors(cfg, z.stage)

    def count_model_state(self, out: MemoryEstimate) -> None:
        from .comm.compression import INT8
        from .zero.planning import QuantizedComm

        compute = _size(self.policy.compute)
        grad = _size(self.policy.grad)
        opt_home = "host" if self.offload.optimizer_device == "cpu" else self.offload.optimizer_device
        opt_home = "device" if opt_home == "none" else opt_home
        param_home = {"none": "device", "cpu": "host", "nvme": "nvme"}[self.offload.param_device]
        fp32_aliased = self.policy.compute == torch.float32 and self.offload.optimizer_device == "none"
        b = out.bytes
        for plan, layout in zip(self.plans, self.layouts):
            shard = layout.shard_numel
            if plan.resident:
                b["parameters"]["device"] += layout.padded_numel * compute
            else:
                b["parameters"][param_home] += shard * compute
            master_aliased = fp32_aliased and (plan.resident or self.offload.param_device == "none")
            if not master_aliased:
                b["optimizer_state"][opt_home] += shard * 4
            b["gradients"][opt_home] += shard * grad
            b["optimizer_state"][opt_home] += shard * 4 * self.state_tensors
        quantized = QuantizedComm.from_config(self.cfg.zero_optimization)
        for plan, layout in zip(self.frozen_plans, self.frozen_layouts):
            if quantized.keeps_int8(plan):  # zero_quantized_nontrainable_weights: int8 plus block scales
                b["parameters"]["device"] += INT8.message_nbytes(layout.shard_numel)
            else:
                b["parameters"][param_home] += layout.shard_numel * compute
        b["parameters"]["device"] += self.outside * compute

    def count_compression(self, out: MemoryEstimate) -> None:
        """A 1-bit optimizer's compression errors (Note [1-bit reduction]): at stage 0 the optimizer's, a worker
        and a server error covering the flat group (4 bytes per parameter; 0/1 Adam two and its local updates:
        12); at stages 1-3 each gradient bucket's, for the chunks this rank sends ((N-1)/N x 4 bytes)."""
        copies = _compression_copies(self.cfg)
        if not copies:
            return
        if self.stage.partition_optimizer:
            errors = sum(layout.padded_numel - layout.shard_numel for layout in self.layouts)
        else:
            n = out.world_size
            errors = copies * sum(-(-layout.padded_numel // n) * n for layout in self.layouts)
        out.bytes["communication_buffers"]["device"] += 4 * errors
        out.notes.append(f"1-bit compression errors: {4 * errors / max(out.params, 1):.2f} bytes per parameter")

    def count_buffers(self, out: MemoryEstimate, gloo: bool) -> None:
        """What ``ReusableBuffers`` holds at the busiest moment: gradient staging for the bucket being filled and
        the one reduction in flight (``MAX_IN_FLIGHT``), the latter with Gloo's reduce-scatter scratch when it is
        sharded; under stage 3 also the root unit, the running unit and the prefetched ones."""
        from .zero.reducer import MAX_IN_FLIGHT

        compute, reduce = _size(self.policy.compute), _size(self.policy.reduce)
        largest = max((layout.padded_numel for layout in self.layouts), default=0)
        staging = (MAX_IN_FLIGHT + 1) * largest * reduce
        scratch = 0
        if gloo and self.shard_count > 1:  # the other ranks' chunks of this rank's part
            scratch = MAX_IN_FLIGHT * largest // self.shard_count * (self.shard_count - 1) * reduce
        out.bytes["communication_buffers"]["device"] += staging + scratch
        if not self.stage.partition_params:
            return
        z = self.cfg.zero_optimization
        sharded_units = [n for i, n in self.unit_numel.items() if i != 0]
        unit = max(sharded_units, default=0)
        ahead = min(
            z.prefetch_bucket_size // max(unit, 1),
            max(z.max_live_parameters // max(unit, 1) - 1, 0),
            max(len(sharded_units) - 1, 0),  # no more units ahead than the model has
        )
        gathered = self.unit_numel.get(0, 0) + (1 + ahead) * unit
        out.bytes["gathered_units"]["device"] += gathered * compute


def _compression_copies(cfg) -> int:
    """fp32 copies of each flat group a 1-bit optimizer keeps after its warm-up, beyond its state: the compression
    errors (worker + server: one copy per tensor compressed), and 0/1 Adam's summed local updates."""
    name = cfg.optimizer.type.lower() if cfg.optimizer is not None else ""
    return {"onebitadam": 1, "onebitlamb": 1, "zerooneadam": 3}.get(name, 0)


def _optimizer_state_tensors(cfg, stage: int) -> int:
    """How many per-element state tensors the configured optimizer keeps: stepped once on one element."""
    from .optim import build_optimizer

    if cfg.optimizer is None:
        return 2  # a client optimizer: Adam's two, the common case
    param = nn.Parameter(torch.zeros(1))
    param.grad = torch.zeros(1)
    optimizer = build_optimizer(
        cfg.optimizer.type, cfg.optimizer.params, [{"params": [param]}], zero_stage=stage, allow_untested=True
    )
    optimizer.step()
    state = optimizer.state[param]
    return sum(1 for v in state.values() if torch.is_tensor(v) and v.numel() == 1 and v.dim() > 0)


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass
class _Activations:
    saved: int  # what autograd keeps after forward (parameters and their views excluded)
    largest_saved: int  # the largest one of those tensors
    recompute: int  # under activation checkpointing: what one block allocates when backward recomputes it


def _trace_activations(model: nn.Module, sample_inputs: Any) -> _Activations:
    """One forward on meta tensors. Saved-tensor hooks count what autograd keeps for backward; a dispatch mode
    counts what each repeated block allocates. A block that saves no more than its inputs runs under activation
    checkpointing (``torch.utils.checkpoint`` installs its own hooks inside and keeps only the block's inputs):
    backward recomputes it, re-allocating its forward at once."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from .zero.stage3.units import repeated_block_classes

    params = {id(p) for p in model.parameters()}
    seen: set[int] = set()
    saved, largest = [0], [0]
    block_saved: dict[int, int] = {}
    block_allocated: dict[int, int] = {}
    current: list[Optional[int]] = [None]

    def pack(t: torch.Tensor):
        base = t._base if t._base is not None else t
        if id(t) in params or id(base) in params or id(base) in seen:
            return t
        seen.add(id(base))
        nbytes = base.numel() * base.element_size()
        saved[0] += nbytes
        largest[0] = max(largest[0], nbytes)
        if current[0] is not None:
            block_saved[current[0]] = block_saved.get(current[0], 0) + nbytes
        return t

    class CountAllocations(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
                # a data-dependent check (``.item()``, ``bool(mask.all())``) on meta data: the trace assumes
                # unpadded, unpacked inputs, so a boolean reads True and a number 0
                return True if args[0].dtype == torch.bool else 0
            out = func(*args, **(kwargs or {}))
            if current[0] is not None:
                inputs = {a.untyped_storage()._cdata for a in tree_leaves((args, kwargs)) if torch.is_tensor(a)}
                fresh = (t for t in tree_leaves(out) if torch.is_tensor(t))
                nbytes = sum(t.untyped_storage().nbytes() for t in fresh if t.untyped_storage()._cdata not in inputs)
                block_allocated[current[0]] = block_allocated.get(current[0], 0) + nbytes
            return out

    classes = repeated_block_classes(model)
    blocks = [m for m in model.modules() if type(m).__name__ in classes]
    block_inputs: dict[int, int] = {}

    def enter(i: int, args) -> None:
        current[0] = i
        block_inputs[i] = sum(a.numel() * a.element_size() for a in tree_leaves(args) if torch.is_tensor(a))

    handles = [m.register_forward_pre_hook(lambda mod, args, i=i: enter(i, args)) for i, m in enumerate(blocks)] + [
        m.register_forward_hook(lambda mod, args, out: current.__setitem__(0, None)) for m in blocks
    ]
    args, kwargs = _split(sample_inputs)
    to_meta = lambda v: v.to("meta") if torch.is_tensor(v) else v  # noqa: E731
    args = tuple(to_meta(a) for a in args)
    kwargs = {k: to_meta(v) for k, v in kwargs.items()}
    try:
        with CountAllocations(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            output = model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    del output
    recompute = max((n for i, n in block_allocated.items() if block_saved.get(i, 0) <= block_inputs[i]), default=0)
    return _Activations(saved[0], largest[0], recompute)


def _split(sample_inputs: Any) -> tuple[tuple, dict]:
    if isinstance(sample_inputs, dict):
        return (), dict(sample_inputs)
    if isinstance(sample_inputs, (tuple, list)):
        return tuple(sample_inputs), {}
    return (sample_inputs,), {}


GLIBC_MMAP_THRESHOLD_MAX = 32 * 2**20  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit glibc


def allocator_retention(largest_transient: int) -> int:
    """Freed memory the host allocator keeps resident, on a CPU run with glibc (0 elsewhere: on GPU the peak is
    ``max_memory_allocated``, which excludes the caching allocator's reserve).

    glibc returns a freed block to the system at once only while it was ``mmap``-ed; each such free raises the
    mmap threshold to the block's size (up to 32 MiB) and the heap's trim threshold to twice that, so after the
    first step a training process's transient tensors (the largest: a fresh parameter gradient or the logits)
    live on the heap, which keeps up to the trim threshold free at its top, and more in holes. The rule, twice the
    trim threshold, is the estimate's roughest term: on the example GPT the resident excess over the tensors in
    use measured 14, 55-60 and 120-140 MiB at 3.3M, 23M and 91M parameters, against 2, 64 and 96 predicted."""
    if not _cpu_only() or platform.libc_ver()[0] != "glibc" or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return 0
    return 4 * min(largest_transient, GLIBC_MMAP_THRESHOLD_MAX)


_RUNTIME_PROBE = """
import json
import torch, torch.distributed as dist
import zeroshard

def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS"))

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
base = rss()
engine, *_ = zeroshard.initialize(
    model=torch.nn.Linear(8, 8),
    config={"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}},
)
engine.backward(engine(torch.ones(1, 8)).sum())
engine.step()
print(json.dumps({"base": base, "warmup": rss() - base}))
"""


@functools.lru_cache(maxsize=1)
def runtime_baseline() -> tuple[int, int]:
    """On CPU: the resident memory of a process that imported torch and zeroshard and joined a Gloo group, and
    what its first training step adds before any model memory (thread pools, kernels' workspaces, the
    optimizer's and the engine's code paths), measured once in a child process. ``(0, 0)`` on a GPU machine,
    where device memory starts empty."""
    if not _cpu_only() or not os.path.exists("/proc/self/status"):
        return 0, 0
    out = subprocess.run([sys.executable, "-c", _RUNTIME_PROBE], capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"zeroshard estimate: the runtime probe failed:\n{out.stderr[-2000:]}")
    probe = json.loads(out.stdout.strip().splitlines()[-1])
    return probe["base"], max(probe["warmup"], 0)


# -- the command line: ``zeroshard estimate`` ------------------------------------------------------------------
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str) -> int:
    """``80GB`` (decimal), ``80GiB`` (binary), or a plain number of bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size: use e.g. 80GB, 80GiB or 85899345920")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


@dataclass(frozen=True)
class Candidate:
    stage: int
    offload: str  # none | cpu (optimizer; under stage 3 the parameters too)
    micro_batch: int
    recompute: bool

    def describe(self) -> str:
        recompute = ", activation checkpointing" if self.recompute else ""
        return f"stage {self.stage}, offload {self.offload}, micro-batch {self.micro_batch}{recompute}"

    def apply(self, config: dict) -> dict:
        out = json.loads(json.dumps(config))
        out["train_micro_batch_size_per_gpu"] = self.micro_batch
        for key in ("train_batch_size", "gradient_accumulation_steps"):
            out.pop(key, None)
        zero = dict(out.get("zero_optimization", {}))
        zero["stage"] = self.stage
        zero.pop("offload_optimizer", None)
        zero.pop("offload_param", None)
        if self.offload == "cpu":
            zero["offload_optimizer"] = {"device": "cpu"}
            if self.stage == 3:
                zero["offload_param"] = {"device": "cpu"}
        out["zero_optimization"] = zero
        return out

    def traffic_per_sample(self, params: int, world: int, element: int) -> float:
        """Bytes moved per rank per sample: collectives (ring) plus host<->device copies when offloading."""
        share = (world - 1) / world
        wire = {0: 2, 1: 2, 2: 2, 3: 3}[self.stage] * share * params * element
        copies = 0 if self.offload == "none" else params * (4 + element) / (world if self.stage else 1)
        return (wire + copies) / self.micro_batch


def _hf_model(config, recompute: bool, layers: Optional[int] = None) -> Callable[[], nn.Module]:
    """A builder of the causal LM an HF config (read once by ``_hf_config``) describes, ``layers`` deep when given."""
    if layers is not None:
        config = copy.deepcopy(config)
        config.num_hidden_layers = layers

    def build():
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(config)
        if recompute:  # newer transformers renamed it
            getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
        return model

    return build


def _hf_config(path: str):
    """A local config only: a missing path is named as such (from_pretrained would try the Hub and report a
    network error)."""
    from transformers import AutoConfig

    if not os.path.exists(path):
        raise FileNotFoundError(f"--hf_config {path}: no such file or directory")
    return AutoConfig.from_pretrained(path)


# Deeper HF models are estimated at two depths and extended linearly: every count the estimate makes is affine in
# the number of identical blocks (model state, activations, gradients) or independent of it (the runtime, the
# largest transient), and building and tracing a 10^5-block model on the meta device would take many minutes.
_TRACED_LAYERS = 32


def _extend(shallow: MemoryEstimate, deep: MemoryEstimate, traced: int, layers: int) -> MemoryEstimate:
    """The estimate at ``layers`` blocks from those at ``traced`` and ``2 * traced`` blocks."""

    def line(a: int, b: int) -> int:
        return a + (b - a) * (layers - traced) // traced

    return MemoryEstimate(
        world_size=deep.world_size,
        stage=deep.stage,
        micro_batch=deep.micro_batch,
        params=line(shallow.params, deep.params),
        bytes={c: {w: line(shallow.bytes[c][w], deep.bytes[c][w]) for w in LOCATIONS} for c in CATEGORIES},
        notes=deep.notes + [f"{layers} layers: extended linearly from {traced} and {2 * traced} layers"],
    )


def _import(spec: str):
    """``MODULE:CALLABLE``; the working directory is searched first, as ``python -m`` would (the console script's
    own directory is on ``sys.path`` instead)."""
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ValueError(f"{spec!r}: expected MODULE:CALLABLE, e.g. my_pkg.models:build")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        found = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"{spec!r}: {err}") from None
    if not callable(found):
        raise ValueError(f"{spec!r} is a {type(found).__name__}, not a callable")
    return found


def build_parser():
    import argparse

    from .launcher.arguments import bounded

    parser = argparse.ArgumentParser(
        prog="zeroshard estimate",
        description="Predict one rank's peak memory for a training configuration (model built on the meta device).",
    )
    parser.add_argument("--config", required=True, help="DeepSpeed/zeroshard JSON config")
    parser.add_argument("--num_gpus", type=bounded(1), default=1, help="ranks per node")
    parser.add_argument("--num_nodes", type=bounded(1), default=1)
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--hf_config", help="a Hugging Face model config (JSON file or directory)")
    model.add_argument("--factory", help="MODULE:CALLABLE returning the model")
    parser.add_argument("--sample_inputs", help="MODULE:CALLABLE(micro_batch, seq_len) returning one micro-batch")
    parser.add_argument("--micro_batch", type=bounded(1), help="overrides train_micro_batch_size_per_gpu")
    parser.add_argument("--seq_len", type=bounded(1), default=512)
    parser.add_argument("--budget", help="per-rank memory, e.g. 80GB: recommend the cheapest setting that fits")
    return parser


def main(argv=None) -> int:
    """``zeroshard estimate``: bad input (a missing file, a config error, a factory that does not import) exits 2
    with one line naming it."""
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except (OSError, ValueError, NotImplementedError) as err:
        print(f"zeroshard estimate: {err}", file=sys.stderr)
        return 2


def _run(args) -> int:
    with open(args.config) as f:
        config = json.load(f)
    if not isinstance(config, dict):
        raise ValueError(f"--config {args.config}: expected a JSON object, got {type(config).__name__}")
    if args.micro_batch:
        config["train_micro_batch_size_per_gpu"] = args.micro_batch
        config.pop("train_batch_size", None)
    world = args.num_gpus * args.num_nodes
    hf_config = _hf_config(args.hf_config) if args.hf_config else None
    layers = getattr(hf_config, "num_hidden_layers", None)
    model_factory = _import(args.factory) if args.factory else None
    sample_factory = _import(args.sample_inputs) if args.sample_inputs else None

    def inputs(micro: int):
        if sample_factory is not None:
            return sample_factory(micro, args.seq_len)
        ids = torch.zeros(micro, args.seq_len, dtype=torch.long, device="meta")
        return {"input_ids": ids, "labels": ids} if args.hf_config else (ids,)

    def predict(recompute: bool, cfg: dict, micro: int) -> Optional[MemoryEstimate]:
        """None where the model cannot be rebuilt with recomputation (a factory's checkpointing is its own)."""
        if hf_config is None:
            return None if recompute else estimate(model_factory, cfg, world, inputs(micro))
        if layers is None or layers <= 2 * _TRACED_LAYERS:
            return estimate(_hf_model(hf_config, recompute), cfg, world, inputs(micro))
        shallow, deep = (
            estimate(_hf_model(hf_config, recompute, n), cfg, world, inputs(micro))
            for n in (_TRACED_LAYERS, 2 * _TRACED_LAYERS)
        )
        return _extend(shallow, deep, _TRACED_LAYERS, layers)

    micro = int(config.get("train_micro_batch_size_per_gpu", 1))
    base = predict(False, config, micro)
    print(base.table())
    if not args.budget:
        return 0
    budget = parse_bytes(args.budget)
    fits = []
    element = _size(
        torch.bfloat16
        if config.get("bf16", {}).get("enabled") or config.get("fp16", {}).get("enabled")
        else torch.float32
    )
    micros = sorted({m for m in (micro, micro // 2, micro // 4, micro // 8) if m >= 1}, reverse=True)
    for stage in (0, 1, 2, 3):
        for offload in ("none", "cpu") if stage else ("none",):
            for recompute in (False, True):
                for m in micros:
                    candidate = Candidate(stage, offload, m, recompute)
                    predicted = predict(recompute, candidate.apply(config), m)
                    if predicted is None:
                        break
                    if predicted.peak <= budget:
                        fits.append(
                            (
                                candidate.traffic_per_sample(base.params, world, element),
                                -m,
                                recompute,
                                candidate,
                                predicted.peak,
                            )
                        )
                        break  # the largest micro-batch that fits
    if not fits:
        print(f"\nnothing fits in {args.budget} per rank: more ranks, NVMe offload or a smaller sequence")
        return 1
    fits.sort(key=lambda f: f[:3])
    print(f"\nsettings that fit in {args.budget} per rank, least traffic per sample first:")
    for traffic, _, _, candidate, peak in fits:
        print(f"  {candidate.describe():<64} peak {peak / 2**30:7.2f} GiB, {traffic / 2**20:9.1f} MiB moved/sample")
    print(f"recommended: {fits[0][3].describe()}")
    return 0
