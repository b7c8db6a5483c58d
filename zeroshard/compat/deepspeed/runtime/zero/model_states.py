"""DeepSpeed's model-state estimates (its documented formulas and printed tables), shared by the stage-2 and
stage-3 entry points. They count parameters, gradients and optimizer state for fp16/bf16 training with Adam,
times ``additional_buffer_factor`` on the CPU side -- not activations, buffers or the runtime, which is why
``zeroshard.estimate`` exists."""

from __future__ import annotations

import torch.nn as nn


def total_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def largest_layer_params(model: nn.Module) -> int:
    """The most parameters one module registers itself (DeepSpeed's "largest layer")."""
    return max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)


def zero2_needs(total: int, num_gpus_per_node: int, num_nodes: int, cpu_offload: bool, buffer_factor: float):
    """(per-CPU, per-GPU) bytes under ZeRO-2."""
    gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        return int(total * max(4 * gpus, 16) * buffer_factor), 2 * total
    return int(total * 4 * num_gpus_per_node * buffer_factor), 4 * total + int(16 * total / gpus)


def zero3_needs(
    total: int,
    largest: int,
    num_gpus_per_node: int,
    num_nodes: int,
    offload_optimizer: bool,
    offload_param: bool,
    zero_init: bool,
    buffer_factor: float,
):
    """(per-CPU, per-GPU) bytes under ZeRO-3: the GPU holds the largest layer gathered (4 bytes per element)
    plus its shares; with ``zero_init`` the CPU never holds the whole model."""
    gpus = num_nodes * num_gpus_per_node
    per_node = 1 / num_nodes
    layer = 4 * largest
    if offload_optimizer and offload_param:
        gpu = layer
        cpu = total * (18 * per_node if zero_init else max(4 * num_gpus_per_node, 18 * per_node))
    elif offload_optimizer:
        gpu = layer + int(2 * total / gpus)
        cpu = total * (16 * per_node if zero_init else max(4 * num_gpus_per_node, 16 * per_node))
    else:
        gpu = layer + int(18 * total / gpus)
        cpu = (largest if zero_init else total) * 4 * num_gpus_per_node
    return int(cpu * buffer_factor), gpu


def header(total: int, num_gpus_per_node: int, num_nodes: int, largest: int = 0) -> list[str]:
    nodes = f"{num_nodes} node{'s' if num_nodes > 1 else ''}"
    gpus = f"{num_gpus_per_node} GPU{'s' if num_gpus_per_node > 1 else ''} per node"
    model = f"Model with {int(total / 1e6)}M total params"
    if largest:
        model += f", {int(largest / 1e6)}M largest layer params"
    return [
        "Estimated memory needed for params, optim states and gradients for a:",
        f"HW: Setup with {nodes}, {gpus}.",
        f"SW: {model}.",
        "  per CPU  |  per GPU |   Options",
    ]


def row(cpu: int, gpu: int, options: str) -> str:
    return f"  {cpu / 2**30:7.2f}GB | {gpu / 2**30:6.2f}GB | {options}"
