"""``deepspeed.runtime.zero.stage3``'s memory estimators: DeepSpeed's model-state formulas."""

from __future__ import annotations

import torch.nn as nn

from .model_states import header, largest_layer_params, row, total_params, zero3_needs


def estimate_zero3_model_states_mem_needs(
    total_params: int,
    largest_layer_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    cpu_offload_params: bool = True,
    zero_init: bool = True,
    additional_buffer_factor: float = 1.5,
) -> tuple[int, int, int]:
    """(per-CPU, per-GPU, largest layer) bytes of model states under ZeRO-3."""
    cpu, gpu = zero3_needs(
        total_params,
        largest_layer_params,
        num_gpus_per_node,
        num_nodes,
        cpu_offload,
        cpu_offload and cpu_offload_params,
        zero_init,
        additional_buffer_factor,
    )
    return cpu, gpu, 4 * largest_layer_params


def estimate_zero3_model_states_mem_needs_all_cold(
    total_params: int,
    largest_layer_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.5,
) -> None:
    """Print the table for a model of ``total_params`` parameters whose largest layer has ``largest_layer_params``."""
    lines = header(total_params, num_gpus_per_node, num_nodes, largest_layer_params)
    for offload_param, offload_optimizer in ((True, True), (False, True), (False, False)):
        for zero_init in (True, False):
            cpu, gpu = zero3_needs(
                total_params,
                largest_layer_params,
                num_gpus_per_node,
                num_nodes,
                offload_optimizer,
                offload_param,
                zero_init,
                additional_buffer_factor,
            )
            options = (
                f"offload_param={'cpu' if offload_param else 'none'}, "
                f"offload_optimizer={'cpu' if offload_optimizer else 'none'}, zero_init={int(zero_init)}"
            )
            lines.append(row(cpu, gpu, options))
    print("\n".join(lines))


def estimate_zero3_model_states_mem_needs_all_live(
    model: nn.Module, num_gpus_per_node: int = 1, num_nodes: int = 1, additional_buffer_factor: float = 1.5
) -> None:
    """Print the table for ``model``."""
    estimate_zero3_model_states_mem_needs_all_cold(
        total_params(model), largest_layer_params(model), num_gpus_per_node, num_nodes, additional_buffer_factor
    )
