"""What ``initialize`` does for a :class:`~zeroshard.pipe.PipelineModule`: the number of stages the mesh gets (and
the combinations refused with it), the ``pipeline`` config block applied to the module, and the groups of the stages
sharing a tied module, whose copies start equal."""

from __future__ import annotations

import warnings
from typing import Optional

import torch

from .. import comm
from ..checkpoint.agreement import failed_ranks, gather_text
from ..pipe import PipelineModule
from ..pipe.module import non_reentrant_checkpoint


def pipeline_stages(model: torch.nn.Module, parsed, *, tp: int, sp: int, ep: int) -> int:
    """The pipeline stages of ``model`` (1 unless it is a ``PipelineModule``), after checking what runs with them and
    applying the config's ``pipeline`` block to it."""
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
    stages = model.num_stages
    stage = parsed.zero_optimization.stage
    if stage >= 3:
        raise NotImplementedError(
            f"ZeRO-3 with pipeline parallelism (zero_optimization.stage {stage}) is not implemented: the 1F1B order "
            "keeps several micro-batches' forwards in flight, and stage 3's gathers are scheduled for one at a time; "
            "use stage 0-2 (ZeRO-2 shards each stage's gradients and optimizer state over its data-parallel ranks)"
        )
    other = {"tensor_parallel.autotp_size": tp, "sequence_parallel_size": sp, "expert parallelism": ep}
    combined = [f"{key} {size}" for key, size in other.items() if size > 1]
    if model.topology().get_dim("model") > 1:
        combined.append(f"a topology with model={model.topology().get_dim('model')}")
    if combined and stages > 1:
        raise NotImplementedError(
            f"pipeline parallelism ({stages} stages) with {', '.join(combined)} is not implemented: pipelines run "
            "with data parallelism and ZeRO 0-2; drop the other axis or the pipeline"
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


def tie_pipeline_stages(model: torch.nn.Module, mesh: comm.Mesh) -> dict[str, Optional[comm.Group]]:
    """For each tie key of a pipeline's model, this rank's group of the stages holding a copy (None: one stage holds
    it, or this rank's stage does not). A collective call (every rank builds every group)."""
    if not isinstance(model, PipelineModule):
        return {}
    ties = {}
    for key, stages in model.tied_keys().items():
        group = comm.stages_group(mesh, tuple(stages), f"tied.{key}") if len(stages) > 1 else None
        if key in model.tied_modules:
            ties[key] = group
    return ties


def start_ties_equal(model: torch.nn.Module, ties: dict[str, Optional[comm.Group]], mesh: comm.Mesh) -> dict:
    """Every stage's copy of a tied module starts from the first stage's (after each stage's ranks started from
    its first rank's weights), once the stages agree on what each copy holds (a spec of one key building other
    shapes or dtypes on another stage would have its bytes copied and its gradients summed across two layouts);
    returns each shared tensor with its tie's group. A collective call for a pipeline with tied layers."""
    if not isinstance(model, PipelineModule) or not model.tied_keys():
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
