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
  under stage 3), plus parameters outside any flat group; with ``expert_parallel`` a rank's experts are
  ``1 / autoep_size`` of each experts tensor, sharded over the ``world / autoep_size`` ranks holding the same ones;
- ``gradients``: the reduced gradient shard (fp32 below stage 3, the compute dtype under it);
- ``optimizer_state``: fp32 master weights (unless they are the fp32 parameters themselves) and the optimizer's
  per-element state (counted by stepping the configured optimizer once on one element);
- ``gathered_units`` (stage 3): the root unit, the running unit and the prefetched ones;
- ``communication_buffers``: gradient staging (one bucket staging, one in flight) and, on Gloo, the chunks the
  reduction in flight receives;
- ``activations``: what forward keeps for backward (traced; under ``layer_major`` that of every micro-batch of the
  step, kept together), backward's first working set (the gradients of the largest saved tensor and of its input,
  and the largest parameter's fresh gradient), and under activation checkpointing one block's recomputation;
- ``runtime``: a training process without its model (CPU: torch, zeroshard, a Gloo group and one training step
  of a tiny model, probed once in a child process; 0 on GPU, where ``max_memory_allocated`` is compared);
- ``allocator``: freed memory glibc keeps resident on a CPU run (``allocator_retention``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch
import torch.nn as nn

from .activations import activation_peak, trace_activations
from .model_state import ModelState, element_size
from .process import allocator_retention, runtime_baseline
from .result import CATEGORIES, LOCATIONS, MemoryEstimate, cpu_only


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
    from ..config import AutoContext, model_hidden_size, parse_config, resolve_config
    from ..offload import OffloadPlan
    from ..precision import PrecisionPolicy

    model = _meta_model(model_or_factory)
    parsed = parse_config(config)
    if parsed.tensor_parallel.autotp_size > 1:
        raise NotImplementedError(
            "zeroshard estimate with tensor_parallel.autotp_size > 1: the estimator plans data parallelism only; "
            "model state per rank is (replicated + split / autotp_size) elements, /dp where ZeRO shards them "
            "(docs/tutorials/tensor-parallel.md)"
        )
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
    experts, pieces = _split_experts(model, parsed, world_size)
    shards = hpz if z.stage >= 1 else 1
    plan = ModelState(model, cfg, policy, offload, shard_count=shards, tensor_splits=pieces, expert_parallel=experts)
    plan.count_model_state(result)
    plan.count_offload(result)
    plan.count_buffers(result, gloo=cpu_only())
    plan.count_compression(result)
    # layer_major (Note [layer-major]): the forward of every micro-batch of the step runs before the backward
    at_once = resolution.batch.gradient_accumulation_steps if z.stage == 3 and z.layer_major else 1
    largest_transient = _count_activations(result, model, sample_inputs, element_size(policy.compute), at_once)
    result.bytes["runtime"]["device"] = sum(runtime_baseline()) if runtime_bytes is None else runtime_bytes
    # NVMe offload bounds glibc's heap (zeroshard.accelerator.bound_host_heap): nothing freed stays resident
    result.bytes["allocator"]["device"] = 0 if offload.on_nvme else allocator_retention(largest_transient)
    return result


def _count_activations(
    result: MemoryEstimate, model: nn.Module, sample_inputs: Any, compute_bytes: int, at_once: int = 1
) -> int:
    """Count the activations of ``at_once`` micro-batches like ``sample_inputs`` kept together for backward (more
    than one under ``layer_major``) into ``result``; returns the largest transient tensor (the largest parameter's
    gradient, or the largest saved activation) the allocator may keep."""
    largest_grad = max((p.numel() for p in model.parameters() if p.requires_grad), default=0) * compute_bytes
    if sample_inputs is None:
        result.notes.append("no sample_inputs: activations not counted")
        return largest_grad
    traced = trace_activations(model, sample_inputs)
    result.bytes["activations"]["device"] = activation_peak([traced] * at_once, largest_grad)
    if at_once > 1:
        result.notes.append(
            f"layer_major: the activations of the step's {at_once} micro-batches are kept together for backward "
            f"({at_once} x {traced.saved / 2**20:.1f} MiB); activation checkpointing keeps only each checkpointed "
            "unit's input of each"
        )
    return max(largest_grad, traced.largest_saved)


def _split_experts(model: nn.Module, parsed, world_size: int) -> tuple[int, dict]:
    """The expert-parallel size and this rank's expert pieces, as ``initialize`` finds them: experts the model
    declares (tagged ``allreduce = False``, DeepSpeed's MoE layers: already this rank's), or, with the
    ``expert_parallel`` block, one rank's experts kept of the meta model (every rank holds as many); 1 and none when
    off."""
    from .. import comm
    from ..moe import declared_expert_parallel, declared_expert_pieces, shard_experts

    settings = parsed.expert_parallel
    declared = declared_expert_parallel(model)  # experts the client split itself (DeepSpeed's protocol)
    if declared is not None:
        comm.ParallelDims.for_world(world_size, shard_group_size=parsed.zero_optimization.shard_group_size, ep=declared)
        return declared, declared_expert_pieces(model, declared)
    if not settings.enabled or settings.autoep_size == 1:
        return 1, {}
    dims = comm.ParallelDims.for_world(
        world_size, shard_group_size=parsed.zero_optimization.shard_group_size, ep=settings.autoep_size
    )
    # only the expert group's size is read: the meta model never runs
    return dims.ep, shard_experts(model, comm.planned_group("expert", dims.ep), settings.preset_model)


def _meta_model(model_or_factory) -> nn.Module:
    if isinstance(model_or_factory, nn.Module):
        import copy

        try:
            with torch.device("meta"):
                copied = copy.deepcopy(model_or_factory).to("meta")
        except (TypeError, RuntimeError) as err:  # e.g. a module holding a process group
            raise TypeError(
                f"zeroshard estimate: the model cannot be copied to plan it ({err}); pass a zero-argument callable "
                "that builds it instead (it is called on the meta device)"
            ) from err
        for original, copy_ in zip(model_or_factory.parameters(), copied.parameters()):
            for tag in ("allreduce", "group_name"):  # DeepSpeed's expert tags: deepcopy leaves them behind
                if hasattr(original, tag):
                    setattr(copy_, tag, getattr(original, tag))
        return copied
    with torch.device("meta"):
        model = model_or_factory()
    if not isinstance(model, nn.Module):
        raise TypeError(f"the model factory returned {type(model).__name__}, not an nn.Module")
    return model.to("meta")
