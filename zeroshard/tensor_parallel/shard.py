"""Sharding a model over a tensor-parallel group: each planned layer (:mod:`.placement`) is replaced by its
tensor-parallel version (:mod:`.layers`) holding this rank's slice, read from a weight source.

For inference (``zeroshard.init_inference``) the replicated parameters are read and placed too; for training
(:func:`shard_for_training`, which ``zeroshard.initialize`` runs under ``tensor_parallel.autotp_size``, and the legacy
:func:`tp_model_init`) every parameter keeps its identity, the sharded ones now holding their slices.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Optional, Union

import torch
from torch import nn

from .. import comm
from ..checkpoint import CheckpointError
from ..checkpoint.weights import ModuleSource, WeightSource
from ..comm.autograd import reduce_from_group
from ..config import parse_config
from ..config.inference import parse_inference_config
from ..partition import TensorSplit, linear_splits
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, VocabParallelHead
from .placement import (
    HEAD_COUNT_ATTRIBUTES,
    WIDTH_ATTRIBUTES,
    LayerPlan,
    LayerSpec,
    PlacementError,
    TensorParallelPlan,
    features,
    layer_specs_from,
    plan_tensor_parallel,
    split_range,
    vocab_range,
)

TRAINABLE_LAYERS = (ColumnParallelLinear, RowParallelLinear)


def tp_model_init(
    model: nn.Module, tp_size: int, dtype: Union[torch.dtype, str, None] = None, config: Any = None, **kwargs: Any
) -> nn.Module:
    """Split ``model``'s layers over ``tp_size`` consecutive ranks for training (DeepSpeed's legacy ``tp_model_init``;
    ``zeroshard.initialize`` does the same from ``tensor_parallel.autotp_size``): the placement of
    :func:`shard_for_training`, applied in place. ``dtype`` casts the floating-point parameters first. Returns the
    model."""
    if kwargs:
        raise TypeError(f"tp_model_init got unexpected argument(s) {sorted(kwargs)}")
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_model_init: tp_size must be an integer >= 1, got {tp_size!r}")
    settings = None if config is None else parse_config(config).tensor_parallel
    if settings is not None and "autotp_size" in settings.model_fields_set and settings.autotp_size != tp_size:
        raise ValueError(
            f"tp_model_init(tp_size={tp_size}) disagrees with the config's tensor_parallel.autotp_size "
            f"{settings.autotp_size}"
        )
    already = sharded_group(model)
    if already is not None:
        raise ValueError(
            f"tp_model_init: the model is already split over {already.size} tensor-parallel ranks; call it once"
        )
    if not comm.is_initialized():
        comm.init_distributed()
    group = comm.tensor_parallel_group(tp_size)
    if dtype is not None:
        model.to(parse_inference_config(None, dtype=dtype).dtype)
    if tp_size > 1:
        specs = layer_specs_from(settings) if settings is not None else ()
        default = settings.partition_config.use_default_specs if settings is not None else True
        shard_for_training(model, group, specs, default)
    return model


def set_autotp_mode(training: bool = False) -> None:
    """DeepSpeed's switch between its AutoTP layers for inference and for training. zeroshard's tensor-parallel layers
    are one kind for both (their communication is differentiable; in training the model keeps its own parameter
    objects, which :func:`shard_for_training` decides), so there is nothing to switch: the argument is checked."""
    if not isinstance(training, bool):
        raise TypeError(f"set_autotp_mode(training=...) takes True or False, got {training!r}")


def shard_for_training(
    model: nn.Module, group: comm.Group, layer_specs: tuple[LayerSpec, ...] = (), use_default_specs: bool = True
) -> TensorParallelPlan:
    """Split ``model`` over ``group`` in place for training: column / row layers as planned (``layer_specs`` first,
    see :func:`~.placement.plan_tensor_parallel`), the embedding and LM head replicated. Every parameter keeps its
    object; a replicated module acting on this rank's heads only gets a hook summing its gradient over the group."""
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("sdpa")
    plan = plan_tensor_parallel(
        model, group.size, layer_specs=layer_specs, use_default_specs=use_default_specs, split_vocabulary=False
    )
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    shard_layers(model, plan, ModuleSource(model), group, Cast(None, device), reload=False, training=True)
    for name in plan.grad_allreduce:
        for param in model.get_submodule(name).parameters():
            param.register_hook(functools.partial(_summed_over, group=group))
    return plan


def sharded_group(model: nn.Module) -> Optional[comm.Group]:
    """The tensor-parallel group a model was split over for training (None: not split)."""
    return next((m.group for m in model.modules() if isinstance(m, TRAINABLE_LAYERS)), None)


def tensor_splits(model: nn.Module) -> dict[str, TensorSplit]:
    """How each split parameter of a model sharded for training is cut, by parameter name (the others are
    replicated)."""
    splits = {}
    for name, module in model.named_modules():
        if isinstance(module, TRAINABLE_LAYERS):
            for attribute, split in module.splits().items():
                splits[f"{name}.{attribute}" if name else attribute] = split
    return splits


def check_forward(model: nn.Module, group: comm.Group, sequence: Optional[comm.Group] = None) -> None:
    """A forward of a few tokens right after the split (Hugging Face language models, whose inputs are known): a
    placement that leaves the model inconsistent (a layer split on the wrong side, e.g. ``q_proj`` row-parallel)
    fails here, at ``initialize``, naming the cause, instead of at the first training step. Evaluation mode, no
    gradients, the CPU RNG restored: it changes nothing. Under sequence parallelism (``sequence``) each rank's 4
    tokens are its piece of one sequence, with their positions in it, as Ulysses attention expects."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    accepted = inspect.signature(model.forward).parameters
    if not isinstance(vocab, int) or "input_ids" not in accepted:
        return
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    training = model.training
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            model.eval()
            first = sequence.rank * 4 if sequence is not None else 0
            positions = {"position_ids": torch.arange(first, first + 4, device=device)[None]}
            model(
                input_ids=torch.zeros(1, 4, dtype=torch.long, device=device),
                **(positions if "position_ids" in accepted else {}),
            )
    except RuntimeError as err:
        raise PlacementError(
            f"tensor parallelism over {group.size} ranks: after splitting the layers as planned, a forward of 4 tokens "
            f"fails ({err}); the placement leaves the model inconsistent (a layer split on the wrong side?): check "
            "tensor_parallel.partition_config.layer_specs"
        ) from None
    finally:
        model.train(training)


def splits_at(
    model: nn.Module, parts: int, layer_specs: tuple[LayerSpec, ...] = (), use_default_specs: bool = True
) -> dict[str, TensorSplit]:
    """How this model's parameters are (or would be) cut over ``parts`` tensor-parallel ranks in training: a model
    already split keeps its own placement at that degree; a whole one is planned as :func:`shard_for_training`
    would (pure: nothing is split). A checkpoint's split records are checked against it."""
    own = tensor_splits(model)
    if sharded_group(model) is not None:
        return {name: dataclasses.replace(split, parts=parts) for name, split in own.items()}
    plan = plan_tensor_parallel(
        model, parts, layer_specs=layer_specs, use_default_specs=use_default_specs, split_vocabulary=False
    )
    out = {}
    for layer in plan.layers:
        module = model.get_submodule(layer.name)
        prefix = f"{layer.name}." if layer.name else ""
        if layer.style in ("column", "row"):
            planned = linear_splits(layer.style, parts, layer.fused, layer.transposed, module.bias is not None)
            out.update({prefix + attribute: split for attribute, split in planned.items()})
    return out


def _summed_over(grad: torch.Tensor, group: comm.Group) -> torch.Tensor:
    """A replicated parameter applied to this rank's heads only: its gradient, summed over the tensor-parallel
    group before it is accumulated (so gradient accumulation sums each micro-batch once)."""
    return reduce_from_group(grad, group)


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


def shard_layers(
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
        w = cast(w.t() if layer.transposed else w)
        return ColumnParallelLinear(w, cast(b), group, layer.fused, layer.transposed)
    if layer.style == "row":
        fan_in, _ = features(module)
        lo, hi = split_range(fan_in, n, rank, f"layer '{layer.name}' input features")
        w = read(weight, 0 if layer.transposed else 1, lo, hi)
        bias_value = cast(read(bias)) if has_bias else None
        return RowParallelLinear(cast(w.t() if layer.transposed else w), bias_value, group, layer.transposed)
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
