"""``zeroshard estimate``: a memory table for a config and a model (a factory or a Hugging Face config), and with
``--budget`` the largest micro-batch and the ZeRO settings that fit.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import re
import sys
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn

from ..offload.aio import OffloadIOError, measure_bandwidth
from .model_state import element_size
from .predict import estimate
from .result import CATEGORIES, LOCATIONS, MemoryEstimate

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


def hf_model(config, recompute: bool, layers: Optional[int] = None) -> Callable[[], nn.Module]:
    """A builder of the causal LM an HF config (read once by ``hf_config``) describes, ``layers`` deep when given."""
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


def hf_config(path: str):
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


def extend(shallow: MemoryEstimate, deep: MemoryEstimate, traced: int, layers: int) -> MemoryEstimate:
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
        disk_per_step={k: line(shallow.disk_per_step[k], deep.disk_per_step[k]) for k in deep.disk_per_step},
    )


def _nvme_path(config: dict) -> Optional[str]:
    """The config's first NVMe offload directory, if it offloads to NVMe."""
    zero = config.get("zero_optimization") or {}
    for key in ("offload_optimizer", "offload_param"):
        block = zero.get(key) or {}
        if block.get("device") == "nvme" and block.get("nvme_path"):
            return str(block["nvme_path"])
    return None


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

    from ..arguments import bounded

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
    parser.add_argument(
        "--disk_probe_mib",
        type=bounded(0, 16384),
        default=256,
        help="with NVMe offload: write and read this much at the config's nvme_path to measure its bandwidth (0: no)",
    )
    return parser


def main(argv=None) -> int:
    """``zeroshard estimate``: bad input (a missing file, a config error, a factory that does not import) exits 2
    with one line naming it."""
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except (OSError, ValueError, NotImplementedError, OffloadIOError) as err:
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
    config_of_hf = hf_config(args.hf_config) if args.hf_config else None
    layers = getattr(config_of_hf, "num_hidden_layers", None)
    model_factory = _import(args.factory) if args.factory else None
    sample_factory = _import(args.sample_inputs) if args.sample_inputs else None

    def inputs(micro: int):
        if sample_factory is not None:
            return sample_factory(micro, args.seq_len)
        ids = torch.zeros(micro, args.seq_len, dtype=torch.long, device="meta")
        return {"input_ids": ids, "labels": ids} if args.hf_config else (ids,)

    def predict(recompute: bool, cfg: dict, micro: int) -> Optional[MemoryEstimate]:
        """None where the model cannot be rebuilt with recomputation (a factory's checkpointing is its own)."""
        if config_of_hf is None:
            return None if recompute else estimate(model_factory, cfg, world, inputs(micro))
        if layers is None or layers <= 2 * _TRACED_LAYERS:
            return estimate(hf_model(config_of_hf, recompute), cfg, world, inputs(micro))
        shallow, deep = (
            estimate(hf_model(config_of_hf, recompute, n), cfg, world, inputs(micro))
            for n in (_TRACED_LAYERS, 2 * _TRACED_LAYERS)
        )
        return extend(shallow, deep, _TRACED_LAYERS, layers)

    micro = int(config.get("train_micro_batch_size_per_gpu", 1))
    base = predict(False, config, micro)
    nvme_path = _nvme_path(config)
    if nvme_path is not None and args.disk_probe_mib and any(base.disk_per_step.values()):
        base.disk_bandwidth = measure_bandwidth(nvme_path, args.disk_probe_mib * 2**20)
    print(base.table())
    if not args.budget:
        return 0
    return _recommend(args.budget, config, micro, base, world, predict)


def _recommend(budget_text: str, config: dict, micro: int, base: MemoryEstimate, world: int, predict) -> int:
    """Print the settings that fit ``budget_text`` per rank (stage, offload, recomputation, the largest micro-batch
    that fits), least traffic per sample first; 1 when none does."""
    budget = parse_bytes(budget_text)
    fits = []
    half = config.get("bf16", {}).get("enabled") or config.get("fp16", {}).get("enabled")
    element = element_size(torch.bfloat16 if half else torch.float32)
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
                        traffic = candidate.traffic_per_sample(base.params, world, element)
                        fits.append((traffic, -m, recompute, candidate, predicted.peak))
                        break  # the largest micro-batch that fits
    if not fits:
        print(f"\nnothing fits in {budget_text} per rank: more ranks, NVMe offload or a smaller sequence")
        return 1
    fits.sort(key=lambda f: f[:3])
    print(f"\nsettings that fit in {budget_text} per rank, least traffic per sample first:")
    for traffic, _, _, candidate, peak in fits:
        print(f"  {candidate.describe():<64} peak {peak / 2**30:7.2f} GiB, {traffic / 2**20:9.1f} MiB moved/sample")
    print(f"recommended: {fits[0][3].describe()}")
    return 0
