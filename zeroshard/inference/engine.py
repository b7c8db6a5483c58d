"""``init_inference``: shard a trained model over a tensor-parallel group and serve it.

Each rank replaces the planned layers (``placement``) by their tensor-parallel versions (``layers``)
holding only its slice, read straight from the weight source (``weights``); everything else is
replicated. Built on the meta device (``init_empty_weights``) a model never holds more than one
full tensor at a time, so a rank's memory is about 1/N of the sharded weights plus the replicated ones.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Optional, Union

import torch
from torch import nn

from .. import comm
from ..accelerator import get_accelerator
from ..checkpoint import CheckpointError
from ..checkpoint.weights import ModuleSource, WeightSource, open_source
from ..comm.autograd import reduce_from_group
from ..comm.backend import local_rank
from ..config import parse_config
from ..config.inference import InferenceConfig, parse_inference_config
from ..log import log_as_launched, log_rank0
from ..zero import parameters_replaced
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, VocabParallelHead
from .placement import (
    HEAD_COUNT_ATTRIBUTES,
    WIDTH_ATTRIBUTES,
    LayerPlan,
    TensorParallelPlan,
    features,
    plan_tensor_parallel,
    split_range,
    vocab_range,
)


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
    group = comm.build_tensor_parallel_group(settings.tp_size)
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
        _shard(model, plan, source, group, Cast(dtype, device), reload=not isinstance(source, ModuleSource))
    finally:
        source.close()
    model.eval()
    engine = InferenceEngine(model, settings, group, plan, device)
    log_rank0(
        f"init_inference: tp_size {settings.tp_size}, {len(plan.layers)} layers sharded, "
        f"{engine.parameter_bytes() / 2**20:.1f} MiB of parameters on rank 0"
    )
    return engine


def tp_model_init(
    model: nn.Module, tp_size: int, dtype: Union[torch.dtype, str, None] = None, config: Any = None, **kwargs: Any
) -> nn.Module:
    """Split ``model``'s layers over ``tp_size`` consecutive ranks for training (DeepSpeed's ``tp_model_init``): the
    same placement and layers as :func:`init_inference`, with differentiable communication, applied in place to
    the model's own parameters (each sharded one keeps its identity and now holds this rank's slice). ``dtype``
    casts the floating-point parameters first. Returns the model."""
    if kwargs:
        raise TypeError(f"tp_model_init got unexpected argument(s) {sorted(kwargs)}")
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_model_init: tp_size must be an integer >= 1, got {tp_size!r}")
    configured = _configured_tp_size(config)
    if configured is not None and configured != tp_size:
        raise ValueError(
            f"tp_model_init(tp_size={tp_size}) disagrees with the config's tensor_parallel.autotp_size {configured}"
        )
    if not comm.is_initialized():
        comm.init_distributed()
    group = comm.build_tensor_parallel_group(tp_size)
    if dtype is not None:
        model.to(parse_inference_config(None, dtype=dtype).dtype)
    if tp_size == 1:
        return model
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("sdpa")
    plan = plan_tensor_parallel(model, tp_size)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    _shard(model, plan, ModuleSource(model), group, Cast(None, device), reload=False, training=True)
    for name in plan.grad_allreduce:
        for param in model.get_submodule(name).parameters():
            param.register_hook(functools.partial(_summed_over, group=group))
    return model


def _summed_over(grad: torch.Tensor, group: comm.Group) -> torch.Tensor:
    """A replicated parameter applied to this rank's heads only: its gradient, summed over the tensor-parallel
    group before it is accumulated (so gradient accumulation sums each micro-batch once)."""
    return reduce_from_group(grad, group)


def _configured_tp_size(config: Any) -> Optional[int]:
    """``tensor_parallel.autotp_size`` of a DeepSpeed config (dict or path), if it sets one."""
    return None if config is None else parse_config(config).tensor_parallel.autotp_size


class Cast:
    """Copies a tensor read from a source into a new tensor on the target device (floating point in the
    target dtype), so no view keeps a full source tensor alive."""

    def __init__(self, dtype: Optional[torch.dtype], device: torch.device):
        self.dtype, self.device = dtype, device

    def __call__(self, tensor: Optional[torch.Tensor], keep_dtype: bool = False) -> Optional[torch.Tensor]:
        if tensor is None:
            return None
        dtype = tensor.dtype if keep_dtype or self.dtype is None or not tensor.is_floating_point() else self.dtype
        return torch.empty(tensor.shape, dtype=dtype, device=self.device).copy_(tensor)


def _aliases(model: nn.Module) -> dict[str, list[str]]:
    """Every name of every tensor: tied weights (GPT-2's LM head and embedding) share one entry."""
    by_tensor: dict[int, list[str]] = {}
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, tensor in named:
        by_tensor.setdefault(id(tensor), []).append(name)
    return {name: names for names in by_tensor.values() for name in names}


class _Reader:
    """Reads by any of a tensor's names, so a checkpoint that stores a tied weight once still loads; every
    tensor's shape is checked against the model's before it is read, and a floating-point tensor of the model
    must come from floating-point data (a slice of the wrong shape or an integer tensor would load silently)."""

    def __init__(self, source: WeightSource, model: nn.Module):
        self.source, self.aliases = source, _aliases(model)
        named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
        self.expected = {name: (tuple(t.shape), t.is_floating_point()) for name, t in named}

    def has(self, name: str) -> bool:
        return any(n in self.source.names for n in self.aliases.get(name, [name]))

    def __call__(self, name: str, dim: Optional[int] = None, start: int = 0, stop: Optional[int] = None):
        for candidate in self.aliases.get(name, [name]):
            if candidate in self.source.names:
                shape, floating = self.expected.get(name, (None, False))
                found = tuple(self.source.shape(candidate))
                if shape is not None and found != shape:
                    raise CheckpointError(
                        f"the checkpoint's '{candidate}' has shape {list(found)}, the model's '{name}' {list(shape)}"
                    )
                value = self.source.read(candidate, dim, start, stop)
                if floating and not value.is_floating_point():
                    raise CheckpointError(
                        f"the checkpoint's '{candidate}' holds {value.dtype} data, the model's '{name}' is "
                        "floating point"
                    )
                return value
        raise CheckpointError(f"the checkpoint has no tensor '{name}' (nor a tied alias of it)")


def _shard(
    model: nn.Module,
    plan: TensorParallelPlan,
    source: WeightSource,
    group: comm.Group,
    cast: Cast,
    reload: bool,
    training: bool = False,
) -> None:
    """Replace the planned layers by their tensor-parallel versions holding this rank's slices. For inference the
    replicated parameters are placed too (read, cast, moved, frozen); for ``training`` every parameter object
    stays the one the model had (a sharded one now holds its slice, with its ``requires_grad``), so optimizers
    and references built before keep working, and the replicated ones are left as they are."""
    read = _Reader(source, model)
    original_weights: dict[int, str] = {}
    for p in plan.layers:
        original_weights.setdefault(id(model.get_submodule(p.name).weight), p.name)
    built: dict[str, nn.Module] = {}
    originals: dict[str, nn.Module] = {}
    ties: dict[str, str] = {}  # a layer -> the layer whose weight it shares
    for layer in plan.layers:  # vocab embeddings come first, so a tied LM head finds its shard
        module = originals[layer.name] = model.get_submodule(layer.name)
        tied_to = original_weights.get(id(module.weight))
        shared = built[tied_to].weight if tied_to != layer.name and tied_to in built else None
        if shared is not None:
            ties[layer.name] = tied_to
        built[layer.name] = _build(layer, module, read, group, cast, shared)
        model.set_submodule(layer.name, built[layer.name])
    if training:  # only now: every layer above was built from the full weights
        for name, layer in built.items():
            if name not in ties:
                _keep_parameters(originals[name], layer)
        for name, tied_to in ties.items():
            built[name].weight = built[tied_to].weight
    else:
        sharded = {id(t) for m in built.values() for t in m.parameters()}
        _place_replicated(model, read, cast, sharded, reload)
    for name in plan.attention:
        module = model.get_submodule(name)
        for attribute in (*HEAD_COUNT_ATTRIBUTES, *WIDTH_ATTRIBUTES):
            value = getattr(module, attribute, None)
            if isinstance(value, int) and not isinstance(value, bool):
                setattr(module, attribute, value // group.size)


def _build(
    layer: LayerPlan,
    module: nn.Module,
    read: _Reader,
    group: comm.Group,
    cast: Cast,
    shared: Optional[nn.Parameter],
) -> nn.Module:
    n, rank = group.size, group.rank
    weight, bias = f"{layer.name}.weight", f"{layer.name}.bias"
    has_bias = getattr(module, "bias", None) is not None
    if layer.style == "column":
        fan_in, fan_out = features(module)
        part = fan_out // layer.fused
        lo, hi = split_range(part, n, rank, f"layer '{layer.name}' output features")
        dim = 1 if layer.transposed else 0
        w = torch.cat([read(weight, dim, k * part + lo, k * part + hi) for k in range(layer.fused)], dim)
        b = torch.cat([read(bias, 0, k * part + lo, k * part + hi) for k in range(layer.fused)]) if has_bias else None
        return ColumnParallelLinear(cast(w.t() if layer.transposed else w), cast(b), group)
    if layer.style == "row":
        fan_in, _ = features(module)
        lo, hi = split_range(fan_in, n, rank, f"layer '{layer.name}' input features")
        w = read(weight, 0 if layer.transposed else 1, lo, hi)
        return RowParallelLinear(cast(w.t() if layer.transposed else w), cast(read(bias)) if has_bias else None, group)
    vocab = module.weight.shape[0]
    start, stop, per = vocab_range(vocab, n, rank)
    if layer.style == "vocab_embedding":
        return VocabParallelEmbedding(_padded(cast(read(weight, 0, start, stop)), per), start, stop, group)
    w = shared if shared is not None else _padded(cast(read(weight, 0, start, stop)), per)
    b = _padded(cast(read(bias, 0, start, stop)), per) if has_bias else None
    return VocabParallelHead(w, b, vocab, group)


def _keep_parameters(original: nn.Module, built: nn.Module) -> None:
    """The tensor-parallel layer takes the original layer's parameter objects, holding its slices now."""
    for attribute in ("weight", "bias"):
        kept, piece = getattr(original, attribute, None), getattr(built, attribute, None)
        if isinstance(kept, nn.Parameter) and piece is not None:
            kept.data = piece.data
            setattr(built, attribute, kept)


def _padded(rows: torch.Tensor, per: int) -> torch.Tensor:
    """The vocabulary slice with zero rows appended up to the common per-rank size."""
    if rows.shape[0] == per:
        return rows
    return torch.cat([rows, rows.new_zeros((per - rows.shape[0], *rows.shape[1:]))])


def _place_replicated(model: nn.Module, read: _Reader, cast: Cast, sharded: set[int], reload: bool) -> None:
    """Every parameter and buffer not sharded: read whole (from the checkpoint, or kept from the model) and
    moved to the device; tied ones stay tied."""
    done: dict[int, torch.Tensor] = {}
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for attribute, param in list(module._parameters.items()):
            if param is None or id(param) in sharded:
                continue
            if id(param) not in done:
                value = read(prefix + attribute) if reload or param.is_meta else param.detach()
                done[id(param)] = nn.Parameter(cast(value), requires_grad=False)
            module._parameters[attribute] = done[id(param)]
        for attribute, buffer in list(module._buffers.items()):
            if buffer is None:
                continue
            if id(buffer) not in done:
                name = prefix + attribute
                if (reload or buffer.is_meta) and read.has(name):
                    value = read(name)
                elif buffer.is_meta:
                    raise CheckpointError(
                        f"buffer '{name}' is on the meta device and not in the checkpoint: build the model under "
                        "zeroshard.init_empty_weights() (parameters on meta, buffers real)"
                    )
                else:
                    value = buffer
                done[id(buffer)] = cast(value, keep_dtype=True)
            module._buffers[attribute] = done[id(buffer)]


def init_empty_weights():
    """Build a model with its parameters on the meta device (no memory) and its buffers real, for
    ``init_inference(model, checkpoint=...)`` to fill with each rank's shards only."""
    return parameters_replaced(
        lambda module, name, param: nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
    )
