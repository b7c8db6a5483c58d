"""``deepspeed.runtime.zero.stage_1_and_2``'s memory estimators: DeepSpeed's model-state formulas."""

from __future__ import annotations

import torch.nn as nn

from .model_states import header, row, total_params, zero2_needs


def estimate_zero2_model_states_mem_needs(
    total_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    additional_buffer_factor: float = 1.5,
) -> tuple[int, int]:
    """(per-CPU, per-GPU) bytes of model states under ZeRO-2."""
    return zero2_needs(total_params, num_gpus_per_node, num_nodes, cpu_offload, additional_buffer_factor)


def estimate_zero2_model_states_mem_needs_all_cold(
    total_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1, additional_buffer_factor: float = 1.5
) -> None:
    """Print the table for a model of ``total_params`` parameters (no model needed)."""
    lines = header(total_params, num_gpus_per_node, num_nodes)
    for offload in (True, False):
        cpu, gpu = zero2_needs(total_params, num_gpus_per_node, num_nodes, offload, additional_buffer_factor)
        lines.append(row(cpu, gpu, f"offload_optimizer={'cpu' if offload else 'none'}"))
    print("\n".join(lines))


def estimate_zero2_model_states_mem_needs_all_live(
    model: nn.Module, num_gpus_per_node: int = 1, num_nodes: int = 1, additional_buffer_factor: float = 1.5
) -> None:
    """Print the table for ``model``."""
    estimate_zero2_model_states_mem_needs_all_cold(
        total_params(model), num_gpus_per_node, num_nodes, additional_buffer_factor
    )
