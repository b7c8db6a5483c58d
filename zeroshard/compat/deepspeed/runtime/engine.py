"""``deepspeed.runtime.engine``: the engine class and DeepSpeed's ``initialize`` signature."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Optional

import torch

from zeroshard import initialize as _initialize
from zeroshard.runtime import ZeroshardEngine
from zeroshard.zero import leaf_paths_of

from ..moe import layer as _moe_layer
from ..utils import live_engines
from ..utils.leaf_modules import get_z3_leaf_modules, set_z3_leaf_module

DeepSpeedEngine = ZeroshardEngine
MoE = _moe_layer.MoE  # DeepSpeed's engine module imports the layer; clients test isinstance(module, MoE)


def autocast_if_enabled(engine: Any) -> contextlib.AbstractContextManager:
    """DeepSpeed's context for its ``torch_autocast`` config block, which zeroshard refuses when enabled: nothing."""
    return contextlib.nullcontext()


def initialize(
    args: Any = None,
    model: Any = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: Optional[int] = None,
    mpu: Any = None,
    dist_init_required: Optional[bool] = None,
    collate_fn: Optional[Callable] = None,
    config: Any = None,
    mesh_param: Any = None,
    config_params: Any = None,
):
    """``deepspeed.initialize``: :func:`zeroshard.initialize` with DeepSpeed's full signature. ``mpu`` is taken when
    it carries sequence-parallel getters (``UlyssesSPAttentionHF.register_with_transformers`` returns one); other
    model parallelism through ``mpu``/``mesh_param`` is refused (tensor parallelism comes from
    ``tensor_parallel.autotp_size``)."""
    if mesh_param is not None:
        raise NotImplementedError(
            "deepspeed.initialize(mesh_param=...): groups from a mesh are not supported by zeroshard; set "
            "tensor_parallel.autotp_size or sequence_parallel_size in the config (the groups are built from it)"
        )
    if distributed_port is not None:
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
    leaves = get_z3_leaf_modules(model) if isinstance(model, torch.nn.Module) else []
    built = _initialize(
        args=args,
        model=model,
        optimizer=optimizer,
        model_parameters=model_parameters,
        training_data=training_data,
        lr_scheduler=lr_scheduler,
        config=config,
        dist_init_required=dist_init_required,
        collate_fn=collate_fn,
        config_params=config_params,
        leaf_modules=leaves,  # flagged by deepspeed.utils.set_z3_leaf_modules
        mpu=mpu,
    )
    live_engines.track(built[0])
    built[0]._broadcast_model()  # where DeepSpeed's engine calls it: a client's replacement runs (its groups exist)
    zero = built[0].settings.zero_optimization
    if zero.stage == 3 and isinstance(model, torch.nn.Module):  # DeepSpeed flags the leaves its config chose
        modules = dict(model.named_modules())
        for path in leaf_paths_of(model, zero):
            set_z3_leaf_module(modules[path], True)
    return built


__all__ = ["DeepSpeedEngine", "initialize"]
