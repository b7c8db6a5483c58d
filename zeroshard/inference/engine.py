"""``init_inference``: shard a trained model over a tensor-parallel group and serve it.

Each rank replaces the planned layers (``zeroshard.tensor_parallel``) by their tensor-parallel versions holding
only its slice, read straight from the weight source (``checkpoint.weights``); everything else is replicated.
Built on the meta device (``init_empty_weights``) a model never holds more than one
full tensor at a time, so a rank's memory is about 1/N of the sharded weights plus the replicated ones.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Union

import torch
from torch import nn

from .. import comm
from ..accelerator import get_accelerator
from ..checkpoint.weights import ModuleSource, open_source
from ..comm.backend import local_rank
from ..config.inference import InferenceConfig, parse_inference_config
from ..log import log_as_launched, log_rank0
from ..tensor_parallel import Cast, TensorParallelPlan, plan_tensor_parallel, shard_layers
from ..zero import parameters_replaced


class InferenceEngine:
    """``engine(*inputs)`` runs the sharded model without autograd; ``engine.generate`` delegates to a
    Hugging Face model's ``generate`` (sampling options and the KV cache work: each rank caches its heads)."""

    def __init__(
        self,
        module: nn.Module,
        config: InferenceConfig,
        group: comm.Group,
        plan: TensorParallelPlan,
        device: torch.device,
    ):
        self.module = module
        self.config = config
        self.group = group
        self.plan = plan
        self.device = device

    def _on_device(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Tensor arguments moved to this rank's device (inputs usually arrive on the CPU)."""

        def move(value: Any) -> Any:
            return value.to(self.device) if isinstance(value, torch.Tensor) else value

        return tuple(move(a) for a in args), {k: move(v) for k, v in kwargs.items()}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = self._on_device(args, kwargs)
        with torch.no_grad():
            return self.module(*args, **kwargs)

    forward = __call__

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        if not hasattr(self.module, "generate"):
            raise TypeError(f"{type(self.module).__name__} has no generate(); call the engine for logits")
        sampling = kwargs.get("do_sample")
        if sampling is None:
            sampling = getattr(getattr(self.module, "generation_config", None), "do_sample", False)
        if sampling:  # every rank must draw the same tokens, or their collectives fall out of step
            seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)
            comm.broadcast(seed, self.group.ranks[0], self.group)
            torch.manual_seed(int(seed))
        args, kwargs = self._on_device(args, kwargs)
        with torch.no_grad():
            return self.module.generate(*args, **kwargs)

    def parameter_bytes(self) -> int:
        """Bytes of this rank's parameters (tied ones once)."""
        return sum(p.numel() * p.element_size() for p in self.module.parameters())


def init_inference(
    model: nn.Module,
    config: Union[dict, str, os.PathLike, None] = None,
    tensor_parallel: Union[dict, int, None] = None,
    dtype: Union[torch.dtype, str, None] = None,
    checkpoint: Union[dict, str, os.PathLike, None] = None,
    injection_policy: Optional[dict] = None,
    mp_size: Optional[int] = None,
    **kwargs: Any,
) -> InferenceEngine:
    """Shard ``model`` over ``tensor_parallel["tp_size"]`` ranks (DeepSpeed's ``init_inference``).

    Weights come from ``checkpoint`` (a state dict, a ``.safetensors`` file, a Hugging Face checkpoint
    directory, or a zeroshard training checkpoint) or, without one, from the model itself; a model
    built under :func:`init_empty_weights` needs ``checkpoint``. Layers are placed automatically for
    GPT-2, Llama-family and OPT models; any other model takes ``injection_policy={BlockClass: ("attn.out",
    "mlp.down")}`` naming the row-parallel layers of each block. The model is modified in place.
    """
    settings = parse_inference_config(
        config,
        tensor_parallel=tensor_parallel,
        dtype=dtype,
        checkpoint=checkpoint,
        injection_policy=injection_policy,
        mp_size=mp_size,
        **kwargs,
    )
    log_as_launched()
    if not comm.is_initialized():
        comm.init_distributed()
    group = comm.tensor_parallel_group(settings.tp_size)
    accelerator = get_accelerator()
    device = accelerator.device(local_rank())
    dtype = settings.dtype
    if dtype is not None and not accelerator.supports_dtype(dtype):
        raise ValueError(f"dtype {dtype} is not supported on {accelerator.name}")
    if hasattr(model, "set_attn_implementation"):  # Hugging Face: attention through scaled_dot_product_attention
        model.set_attn_implementation("sdpa")
    plan = plan_tensor_parallel(
        model, settings.tp_size, settings.injection_policy, settings.tensor_parallel.vocab_parallel_min_bytes
    )
    source = open_source(settings.checkpoint, model)
    try:
        shard_layers(model, plan, source, group, Cast(dtype, device), reload=not isinstance(source, ModuleSource))
    finally:
        source.close()
    model.eval()
    engine = InferenceEngine(model, settings, group, plan, device)
    log_rank0(
        f"init_inference: tp_size {settings.tp_size}, {len(plan.layers)} layers sharded, "
        f"{engine.parameter_bytes() / 2**20:.1f} MiB of parameters on rank 0"
    )
    return engine


def init_empty_weights():
    """Build a model with its parameters on the meta device (no memory) and its buffers real, for
    ``init_inference(model, checkpoint=...)`` to fill with each rank's shards only."""
    return parameters_replaced(
        lambda module, name, param: nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
    )
