"""Placing a model on the mesh before ZeRO shards it (torchtitan's ``parallelize``): every rank starts from the
same weights, then tensor parallelism splits layers over the tensor group, expert parallelism keeps each rank's
experts, and a pipeline's stages sharing a tied module start its copies equal. What it returns (:class:`ParallelPlan`)
is the split parameters with how each is cut and a pipeline's ties; ZeRO's planning takes them once.

The sizes of the mesh's dimensions come from here too: ``tensor_parallel.autotp_size`` (or a pipeline topology's
``model`` axis), the experts' group, and the pipeline's stages with the config's ``pipeline`` block applied to it."""

from __future__ import annotations

import dataclasses
import warnings
from types import MappingProxyType
from typing import Mapping, Optional

import torch

from .. import comm
from ..checkpoint.agreement import failed_ranks, gather_text
from ..log import log_rank0
from ..moe import declared_expert_parallel, declared_expert_pieces, find_fused_experts, moe_layers, shard_experts
from ..pipe import PipelineModule
from ..pipe.module import non_reentrant_checkpoint
from ..tensor_parallel import check_forward, layer_specs_from, shard_for_training, sharded_group, tensor_splits


@dataclasses.dataclass(frozen=True)
class PipelineTies:
    """A pipeline's tied modules on this rank: each tie key with this rank's group of the stages holding a copy (None:
    one stage holds it), derived on the mesh and released with it; and each shared tensor with its group (the
    ZeRO stack sums their gradients over it)."""

    groups: Mapping[str, Optional[comm.Group]]
    tensors: Mapping[torch.Tensor, comm.Group]


@dataclasses.dataclass(frozen=True)
class ParallelPlan:
    """What ``parallelize`` did: every split parameter with how the whole tensor is cut, and for a
    :class:`~zeroshard.pipe.PipelineModule` its ties (None: not a pipeline)."""

    pieces: Mapping[torch.nn.Parameter, object]
    pipeline: Optional[PipelineTies] = None

    @property
    def tied(self) -> Mapping[torch.Tensor, comm.Group]:
        return self.pipeline.tensors if self.pipeline is not None else MappingProxyType({})


def parallelize(model: torch.nn.Module, cfg, mesh: comm.Mesh, materialize) -> ParallelPlan:
    """Tensor parallelism, then expert parallelism (each off unless the mesh has its dimension), then a pipeline's
    ties. Experts the client split itself (DeepSpeed's expert-parameter protocol) start from the first rank holding
    the same ones, everything else from the first rank of its stage."""
    pieces = _split(model, cfg, mesh, materialize)
    if not isinstance(model, PipelineModule):
        return ParallelPlan(pieces)
    groups = _tie_groups(model, mesh)
    return ParallelPlan(pieces, PipelineTies(groups, _start_ties_equal(model, groups, mesh)))


def _split(model: torch.nn.Module, cfg, mesh: comm.Mesh, materialize) -> dict:
    """The tensor- and expert-parallel pieces of ``model``, each with how the whole tensor is cut."""
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
    when enabled; both given must agree (1: off). A pipeline's stages hold different layers, so what they declare is
    agreed over the world first (a collective call for a ``PipelineModule``): stages without experts take the size
    the others declare, stages declaring different sizes are refused by name."""
    size = declared_expert_parallel(model)
    if isinstance(model, PipelineModule):
        size = _agreed_over_stages(size, model)
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


def _agreed_over_stages(size: Optional[int], model: PipelineModule) -> Optional[int]:
    """The one expert-parallel size the pipeline's stages declare (None: none does); every rank answers alike."""
    declared = gather_text(str(size or ""), comm.world_group())
    sizes = sorted({int(text) for text in declared if text.isdigit()})
    if len(sizes) > 1:
        by_stage = {f"stage {model.topology().get_coord(rank).pipe}": text for rank, text in enumerate(declared)}
        raise NotImplementedError(
            f"the pipeline's stages declare expert groups of different sizes ({by_stage}): one expert group size "
            "per model is implemented"
        )
    return sizes[0] if sizes else None


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
    (``tp_model_init``), or a pipeline topology's ``model`` axis; those given must agree."""
    sources = {}
    already = sharded_group(model)
    if already is not None:
        sources["the model was split over (tp_model_init)"] = already.size
    if isinstance(model, PipelineModule) and "model" in model.topology().get_axis_names():
        sources["the PipelineModule's topology has model="] = model.topology().get_dim("model")
    if "autotp_size" in settings.model_fields_set or not sources:
        sources["the config's tensor_parallel.autotp_size is"] = settings.autotp_size
    if len(set(sources.values())) > 1:
        said = "; ".join(f"{what} {size}" for what, size in sources.items())
        raise ValueError(f"the tensor-parallel size disagrees: {said}; make them agree")
    return next(iter(sources.values()))


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


def pipeline_stages(model: torch.nn.Module, parsed, *, sp: int) -> int:
    """The pipeline stages of ``model`` (1 unless it is a ``PipelineModule``), after checking what runs with them
    (``sp``: the sequence-parallel size, which a topology's ``sequence`` axis must be) and applying the config's
    ``pipeline`` block to it."""
    block = parsed.pipeline
    if not isinstance(model, PipelineModule):
        given = sorted(block.model_fields_set)
        if given:
            warnings.warn(
                f"the config's pipeline block ({given}) applies to a deepspeed.pipe.PipelineModule; this model is a "
                f"{type(model).__name__}: ignored, as DeepSpeed ignores it",
                stacklevel=4,
            )
        return 1
    stages = model.topology().get_dim("pipe")  # ranks (a DualPipeVModule runs two of its num_stages on each)
    axis = model.topology().get_dim("sequence")
    if axis and axis != sp:
        raise ValueError(
            f"the PipelineModule's topology has sequence={axis} but the sequence-parallel size is {sp} (the mpu's "
            "group, or sequence_parallel_size); build the topology for the sequence parallelism it runs with"
        )
    if parsed.zero_optimization.layer_major:
        raise NotImplementedError(
            "zero_optimization.layer_major with a PipelineModule: the pipeline engine's train_batch runs its stages' "
            "micro-batches in the 1F1B order, each stage gathering its own layers; drop layer_major"
        )
    split = [
        n
        for n, p in model.named_parameters()
        if getattr(p, "tensor_model_parallel", False) or getattr(p, "model_parallel", False)
    ]
    if split:
        raise NotImplementedError(
            f"the PipelineModule's parameter {split[0]} is marked tensor_model_parallel / model_parallel: its layer "
            "was split by the client's own tensor-parallel code (Megatron's mpu), which zeroshard cannot see into; "
            "build the layers whole and let zeroshard split them (the topology's model axis or "
            "tensor_parallel.autotp_size, with tensor_parallel.partition_config.layer_specs)"
        )
    if block.stages is not None and block.stages != stages:
        raise ValueError(
            f"the config's pipeline.stages is {block.stages} but the PipelineModule was built with {stages} stages "
            '(num_stages= / topology=); make them agree or write "auto"'
        )
    for key in sorted({"partition", "seed_layers"} & block.model_fields_set):
        warnings.warn(
            f"the config's pipeline.{key}: the PipelineModule's own arguments decide it (partition_method=, "
            "seed_layers=), as in DeepSpeed; ignored",
            stacklevel=4,
        )
    if block.activation_checkpoint_interval > 0:
        model.set_checkpoint_interval(block.activation_checkpoint_interval)
    if block.use_reentrant is False:
        model.activation_checkpoint_func = non_reentrant_checkpoint
    return stages


def _tie_groups(model: PipelineModule, mesh: comm.Mesh) -> dict[str, Optional[comm.Group]]:
    """For each tie key of a pipeline's model this rank's stage holds, its group of the stages holding a copy (None:
    one stage holds it), derived on the mesh: the ranks at those stages of each pipe group. A collective call (every
    rank derives every group)."""
    ties = {}
    for key, stages in model.tied_keys().items():
        group = None
        if len(stages) > 1:
            parts = [[pipe[s] for s in stages] for pipe in mesh.dims.derived("pipe")]
            group = mesh.derive(f"tied.{key}", parts)
        if key in model.tied_modules:
            ties[key] = group
    return ties


def _start_ties_equal(model: PipelineModule, ties: dict[str, Optional[comm.Group]], mesh: comm.Mesh) -> dict:
    """Every stage's copy of a tied module starts from the first stage's (after each stage's ranks started from
    its first rank's weights), once the stages agree on what each copy holds (a spec of one key building other
    shapes or dtypes on another stage would have its bytes copied and its gradients summed across two layouts);
    returns each shared tensor with its tie's group. A collective call for a pipeline with tied layers."""
    if not model.tied_keys():
        return {}
    errors = [_tie_error(model, key, group, mesh) for key, group in ties.items()]
    error = next((e for e in errors if e is not None), None)
    failed = failed_ranks(error, mesh.world)  # every rank raises, those of no tie group too
    if error is not None:
        raise ValueError(error)
    if failed:
        raise ValueError(f"rank {comm.get_rank()}: tied layers differ between the stages of rank {failed[0]} (its own "
                         "error names the layer and the shapes)")  # fmt: skip
    tied = {}
    with torch.no_grad():
        for key, group in ties.items():
            if group is None:
                continue
            for tensor in model.tied_parameters(key):
                comm.broadcast(tensor.data, src=group.ranks[0], group=group)
                tied[tensor] = group
    return tied


def _tie_error(model: PipelineModule, key: str, group: Optional[comm.Group], mesh: comm.Mesh) -> Optional[str]:
    """What is wrong with tied module ``key`` on this stage: a ``tied_weight_attr`` it lacks, or copies that differ
    between the stages of ``group`` (None: nothing). Collective over ``group`` whatever this stage finds."""
    try:
        tensors = model.tied_parameters(key)
        missing = None
    except AttributeError:
        tensors, names = [], sorted(n for n, _ in model.tied_modules[key].named_parameters())
        missing = (
            f"tied layer '{key}': tied_weight_attr {model.tied_weight_attrs[key]} names no attribute of its "
            f"{type(model.tied_modules[key]).__name__} (its parameters: {names})"
        )
    if group is None:
        return missing
    layouts = gather_text("; ".join(f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in tensors), group)
    if missing is not None or len(set(layouts)) == 1:
        return missing
    described = ", ".join(
        f"stage {mesh.dims.coordinate(rank, 'pp')} builds [{layout}]" for rank, layout in zip(group.ranks, layouts)
    )
    return (
        f"tied layer '{key}': the stages holding it build different parameters ({described}); the TiedLayerSpecs of "
        "one key must build the same module on every stage"
    )
