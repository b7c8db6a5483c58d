"""Placing a model on the mesh before ZeRO shards it (torchtitan's ``parallelize``): every rank starts from the
same weights, then tensor parallelism splits layers over the tensor group and expert parallelism keeps each rank's
experts. What each returns is the split parameters with how each is cut; ZeRO's planning takes them once."""

from __future__ import annotations

import torch

from .. import comm
from ..log import log_rank0
from ..moe import declared_expert_parallel, declared_expert_pieces, find_fused_experts, moe_layers, shard_experts
from ..tensor_parallel import check_forward, layer_specs_from, shard_for_training, sharded_group, tensor_splits


def parallelize(model: torch.nn.Module, cfg, mesh: comm.Mesh, materialize) -> dict:
    """Tensor parallelism, then expert parallelism (each off unless the mesh has its dimension); returns every split
    parameter with how the whole tensor is cut. Experts the client split itself (DeepSpeed's expert-parameter
    protocol) start from the first rank holding the same ones, everything else from rank 0."""
    ep = mesh.expert.size
    own = declared_expert_pieces(model, ep)
    pieces = _apply_tensor_parallel(model, cfg, mesh, materialize, skip=frozenset(own))
    if not own:
        pieces.update(_apply_expert_parallel(model, cfg, mesh, materialize))
        return pieces
    if materialize is not None:
        raise NotImplementedError(
            "a model built under zeroshard.zero.Init with expert parameters (allreduce=False): build it normally"
        )
    with torch.no_grad():
        for param in own:
            comm.broadcast(param.data, src=mesh.expert_gradient.ranks[0], group=mesh.expert_gradient)
    for layer in moe_layers(model):
        layer.use_expert_group(mesh.expert)
    log_rank0(
        f"expert parallelism: {len(own)} expert tensors (tagged allreduce=False, group_name ep_size_{ep}) split over "
        f"{ep} ranks, sharded over {mesh.expert_shard.size} rank(s) holding the same experts"
    )
    return {**pieces, **own}


def expert_parallel_size(model: torch.nn.Module, settings) -> int:
    """The expert-parallel size: the tagged experts' group (DeepSpeed's protocol), or ``expert_parallel.autoep_size``
    when enabled; both given must agree (1: off)."""
    size = declared_expert_parallel(model)
    configured = settings.autoep_size if settings.enabled else None
    if size is None:
        return configured or 1
    if configured is not None:
        raise ValueError(
            f"the model's expert parameters are tagged for expert groups of {size} ranks (allreduce=False, "
            f"group_name ep_size_{size}) and the config enables expert_parallel (autoep_size {configured}): the "
            "experts are split already; remove the expert_parallel block"
        )
    return size


def broadcast_module(module: torch.nn.Module, group: comm.Group, skip: frozenset = frozenset()) -> None:
    """Start every rank of ``group`` from its first rank's weights, as DDP and DeepSpeed do (``skip``: tensors
    this group does not share)."""
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            if tensor.is_meta or tensor in skip:
                continue  # built under zero.Init: materialized identically on every rank from one seed
            comm.broadcast(tensor.data, src=group.ranks[0], group=group)


def tensor_parallel_size(model: torch.nn.Module, settings) -> int:
    """``tensor_parallel.autotp_size``, or the size of the group the model was already split over
    (``tp_model_init``); the two must agree when both are given."""
    already = sharded_group(model)
    if already is None:
        return settings.autotp_size
    if "autotp_size" in settings.model_fields_set and settings.autotp_size != already.size:
        raise ValueError(
            f"the model was split over {already.size} tensor-parallel ranks (tp_model_init) but the config's "
            f"tensor_parallel.autotp_size is {settings.autotp_size}; make them agree"
        )
    return already.size


def _apply_tensor_parallel(model: torch.nn.Module, cfg, mesh: comm.Mesh, materialize, skip: frozenset) -> dict:
    """Every rank starts from rank 0's weights (``skip``: tensors the ranks do not share); under tensor parallelism
    each then keeps its pieces. Returns the split parameters with how each is cut ({} without tensor
    parallelism)."""
    if mesh.tensor.size > 1:
        return _split_over_tensor_group(model, cfg, mesh, materialize)
    broadcast_module(model, mesh.stage, skip)
    return {}


def _split_over_tensor_group(model: torch.nn.Module, cfg, mesh: comm.Mesh, materialize) -> dict:
    """Tensor parallelism: every rank starts from the same weights, then keeps its pieces (a model ``tp_model_init``
    split already keeps its own: its replicated weights are shared over the world, its pieces over the
    gradient group). Returns the split parameters, each with how it is cut (recorded here, once)."""
    if materialize is not None:
        raise NotImplementedError(
            "a model built under zeroshard.zero.Init with tensor_parallel.autotp_size > 1: build it normally (its "
            "layers are split before ZeRO shards them), or use ZeRO without tensor parallelism"
        )
    already = sharded_group(model) is not None
    if not already:
        broadcast_module(model, mesh.stage)
        settings = cfg.tensor_parallel
        shard_for_training(model, mesh.tensor, layer_specs_from(settings), settings.partition_config.use_default_specs)
        check_forward(model, mesh.tensor, mesh.sequence)
    splits = tensor_splits(model)
    pieces = {p: splits[name] for name, p in model.named_parameters() if name in splits}
    if already:
        broadcast_module(model, mesh.tensor, skip=frozenset(pieces))
        broadcast_module(model, mesh.gradient)
    log_rank0(
        f"tensor parallelism: {len(pieces)} parameters split over {mesh.tensor.size} ranks, ZeRO over "
        f"{mesh.gradient.size} data-parallel rank(s)"
    )
    return pieces


def _apply_expert_parallel(model: torch.nn.Module, cfg, mesh: comm.Mesh, materialize) -> dict:
    """AutoEP (``expert_parallel``): after every rank started from the same weights, each keeps its expert group
    position's experts. Returns them, each with how the whole tensor is cut ({} when off)."""
    settings = cfg.expert_parallel
    if not settings.enabled:
        return {}
    if materialize is not None:
        raise NotImplementedError(
            "a model built under zeroshard.zero.Init with expert_parallel enabled: build it normally (its experts are "
            "split before ZeRO shards them)"
        )
    if mesh.expert.size == 1:  # every expert local (DeepSpeed's autoep_size 1): the model stays as it is
        find_fused_experts(model, settings.preset_model)
        return {}
    spans_tensor = mesh.dims.splits_over_tensor("ep")  # AutoEP folded with AutoTP: tensor ranks route their own tokens
    pieces = shard_experts(model, mesh.expert, settings.preset_model, mesh.tensor if spans_tensor else None)
    log_rank0(
        f"expert parallelism: {len(pieces)} expert tensors split over {mesh.expert.size} ranks"
        + (f" ({mesh.dims.ep_in_tp} of each tensor group's)" if spans_tensor else "")
        + f", sharded over {mesh.expert_shard.size} rank(s) holding the same experts"
    )
    return pieces


def refuse_experts_split_by_transformers(model: torch.nn.Module) -> None:
    """Experts transformers already split over its own expert-parallel group (``DistributedConfig(ep_size=...)``:
    DTensor experts, its own token exchange) are refused by name before anything happens: splitting them again
    would double-shard them."""
    split = [path for path, m in model.named_modules() if getattr(m, "_is_expert_parallel", False)]
    if split:
        raise NotImplementedError(
            f"{split[0]} is already split over an expert-parallel group by transformers (DistributedConfig / "
            "base_model_ep_plan): load the model without it and set the expert_parallel config block (zeroshard "
            "splits the experts and shards them with ZeRO)"
        )
