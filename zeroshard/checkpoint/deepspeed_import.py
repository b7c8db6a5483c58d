"""Importing a checkpoint DeepSpeed wrote (ZeRO stages 1-3, fp32 / bf16 / fp16 training) as a zeroshard checkpoint,
so a run moves over mid-training at any world size and stage, its optimizer state included.

DeepSpeed's files are torch pickles. They are read with torch's restricted unpickler (``weights_only=True``), which
rebuilds tensors, containers and plain values only; the few DeepSpeed classes these files hold are mapped to plain
stand-ins here (a loss scaler's attributes, a fragment address, the ZeRO stage number), so DeepSpeed need not be
installed and none of its code (nor anything else) runs. Any other class is refused naming it and the file; data
that expands without bound through shared references is refused (:mod:`.restricted_pickle`); every field read is
checked first (:mod:`.deepspeed_fields`), so a malformed or edited file is an error naming the file and the field.

Layouts, per optimizer parameter group, in ``param_shapes`` order:

- stages 1-2 (``zero_pp_rank_R_mp_rank_00_optim_states.pt``, ``bf16_`` prefixed under bf16): the parameters packed
  back to back in one flat buffer, cut into equal contiguous partitions, one per rank
  (``single_partition_of_fp32_groups``; the last one without its tail padding). The optimizer's state tensors
  (``base_optimizer_state``) cover the same partitions, padding included.
- stage 3: each parameter is cut on its own into ``ceil(numel / world)`` elements per rank (the last padded); a
  rank's ``fp32_flat_groups`` entry and its optimizer state are its pieces of every parameter, back to back.

The import writes one rank file (fp32 masters and optimizer state, one flat group per parameter group, plus buffers
and client tensors) and a manifest, into ``.<tag>.tmp`` and committed like a save: a failure leaves nothing
behind, and an existing checkpoint of that tag is never replaced. Not imported (named errors or warnings): tensor
(model) parallel checkpoints, frozen parameters, client state that is not plain data (warned, left out), RNG states
(DeepSpeed does not save them).
"""

from __future__ import annotations

import glob
import math
import os
import re
from typing import Any, Optional

import torch

from .deepspeed_fields import STATE_KEYS as _STATE_KEYS
from .deepspeed_fields import (
    RankRecord,
    agreed_stage,
    agreed_step,
    check_same_hyperparameters,
    model_states,
    rank_record,
)
from .deepspeed_pipeline import join_stages, layer_files, stage_buffers
from .deepspeed_ranks import check_partitions, check_stage3_pieces
from .deepspeed_record import ENGINE_KEYS, DeepSpeedCheckpoint, hyperparameters, read_deepspeed_file, update_rule
from .manifest import plain_name
from .safetensors_io import CheckpointError


def is_deepspeed_checkpoint(directory: str) -> bool:
    """Whether ``directory`` (or its ``latest`` tag) holds DeepSpeed's files rather than a zeroshard manifest."""
    for where in (directory, os.path.join(directory, latest_tag(directory) or "")):
        if glob.glob(os.path.join(where, "*mp_rank_00_model_states.pt")):
            return True
    return False


def latest_tag(directory: str) -> Optional[str]:
    """The tag DeepSpeed's ``latest`` file names in ``directory``, or None."""
    try:
        with open(os.path.join(directory, "latest")) as f:
            return plain_name(f.read().strip(), "tag in 'latest'", directory)
    except (OSError, UnicodeDecodeError):
        return None


def read_deepspeed_checkpoint(ds_dir: str, tag: Optional[str] = None) -> DeepSpeedCheckpoint:
    tag = tag if tag is not None else latest_tag(ds_dir)
    if tag is None:
        raise CheckpointError(f"{ds_dir}: no 'latest' file; pass the tag (the step directory's name) with --tag")
    path = os.path.join(ds_dir, plain_name(tag, "tag", ds_dir))
    model_files = sorted(glob.glob(os.path.join(path, "*mp_rank_*_model_states.pt")))  # stage 3: one per rank too
    if not model_files:
        raise CheckpointError(f"{path}: no DeepSpeed model states (mp_rank_00_model_states.pt) here")
    layers = layer_files(path)
    if not layers:  # one model: the first file (stage 3 writes one per rank, each with the model states)
        if any(not re.search(r"mp_rank_00_model_states\.pt$", f) for f in model_files):
            raise CheckpointError(f"{path}: a tensor-parallel DeepSpeed checkpoint (mp_rank_01...) is not importable")
        return _read_stage(path, 0, layers, model_files[0], read_deepspeed_file(model_files[0]))
    stage_files = [f for f in model_files if re.fullmatch(r"mp_rank_\d\d_model_states\.pt", os.path.basename(f))]
    models = [read_deepspeed_file(f) for f in stage_files]
    said = models[0].get("mp_world_size") if models and isinstance(models[0], dict) else None  # the stage count
    expected = [os.path.join(path, f"mp_rank_{mp:02d}_model_states.pt") for mp in range(len(stage_files))]
    if not stage_files or stage_files != expected or said != len(stage_files):
        raise CheckpointError(
            f"{path}: the pipeline's stage files are {[os.path.basename(f) for f in stage_files]}, and stage 0's model "
            f"states say mp_world_size {said!r}; a pipeline of N stages has mp_rank_00 .. mp_rank_<N - 1>: a stage's "
            "files are missing"
        )
    stages = [_read_stage(path, mp, layers, file, model) for mp, (file, model) in enumerate(zip(stage_files, models))]
    return join_stages(path, stages)


def _read_stage(path: str, mp: int, layers: dict, model_file: str, model: Any) -> DeepSpeedCheckpoint:
    """Model-parallel rank ``mp``'s files (``model_file``, read: ``model``, its model states): the whole model's, or
    one pipeline stage's (``layers``: the layer files, where a stage's module weights are)."""
    if isinstance(model, dict) and (model.get("frozen_param_shapes") or model.get("frozen_param_fragments")):
        raise CheckpointError(f"{path}: frozen parameters in a DeepSpeed checkpoint are not importable yet")
    module = stage_buffers(path, model, layers) if layers and isinstance(model, dict) else None
    states = model_states(model_file, model, module)
    world, groups = states.world, states.groups
    present = len(glob.glob(os.path.join(path, f"*zero_pp_rank_*_mp_rank_{mp:02d}_optim_states.pt")))
    if present > world:
        raise CheckpointError(
            f"{path}: {present} ranks' optimizer files, but the model states say dp_world_size {world}: files of "
            "different runs"
        )
    ranks = [rank_record(*_optim_file(path, rank, mp), groups) for rank in range(world)]
    stage = agreed_stage(path, ranks)
    check_same_hyperparameters(path, ranks)
    inner, base = [r.inner for r in ranks], [r.base for r in ranks]
    rule = update_rule(path, states.config, base[0]["param_groups"])
    if stage < 3:
        check_partitions(path, groups, inner, world)
    else:
        check_stage3_pieces(path, groups, inner, base, world, rule)
    masters: dict = {}
    moments: dict = {key: {} for key in _STATE_KEYS}
    unpack = _unpack_flat if stage < 3 else _unpack_per_param
    for g, params in enumerate(groups):
        for key, flats in _group_pieces(ranks, g).items():
            values = unpack(path, g, params, flats, inner[0], world)
            (masters if key == "master" else moments[key]).update(values)
    return DeepSpeedCheckpoint(
        path=path,
        stage=stage,
        world_size=world,
        groups=groups,
        hyper=[hyperparameters(path, g, group, rule) for g, group in enumerate(base[0]["param_groups"])],
        update_rule=rule,
        steps=[agreed_step(path, ranks, g) for g in range(len(groups))],
        masters=masters,
        states=moments,
        counters=states.counters,
        config=states.config,
        lr_scheduler=states.lr_scheduler,
        buffers=states.buffers,
        aliases=states.aliases,
        client_state={k: v for k, v in model.items() if k not in ENGINE_KEYS},
    )


def _optim_file(path: str, rank: int, mp: int = 0) -> tuple[str, Any]:
    for prefix in ("", "bf16_"):
        candidate = os.path.join(path, f"{prefix}zero_pp_rank_{rank}_mp_rank_{mp:02d}_optim_states.pt")
        if os.path.exists(candidate):
            return candidate, read_deepspeed_file(candidate)
    raise CheckpointError(
        f"{path}: rank {rank}'s optimizer states (zero_pp_rank_{rank}_mp_rank_{mp:02d}_optim_states.pt) are missing; "
        "the model states say the checkpoint was written by more ranks"
    )


def _group_pieces(ranks: list[RankRecord], g: int) -> dict[str, list[torch.Tensor]]:
    """Each rank's flat tensor of group ``g``: masters and each optimizer state, trimmed to the master's length."""
    masters = [r.masters[g] for r in ranks]
    out = {"master": masters}
    for name in _STATE_KEYS:
        out[name] = [r.base["state"][g][name].float().reshape(-1)[: m.numel()] for r, m in zip(ranks, masters)]
    return out


def _unpack_flat(path: str, g: int, params: list, flats: list, inner0: dict, world: int) -> dict[str, torch.Tensor]:
    """Stages 1-2: the ranks' partitions joined are the group's flat buffer, parameters back to back."""
    flat = torch.cat(flats)
    every_group = inner0.get("param_alignment_paddings") or []
    paddings = every_group[g] if g < len(every_group) else []
    out, offset = {}, 0
    for i, (name, shape) in enumerate(params):
        numel = math.prod(shape)
        if offset + numel > flat.numel():
            raise CheckpointError(f"{path}: parameter group {g} holds {flat.numel()} values, too few for {name}")
        out[name] = flat[offset : offset + numel].view(shape).clone()
        offset += numel + (int(paddings[i]) if i < len(paddings) else 0)
    return out


def _unpack_per_param(path: str, g: int, params: list, flats: list, inner0: dict, world: int) -> dict:
    """Stage 3: each rank holds ``ceil(numel / world)`` values of every parameter, back to back."""
    out, offset = {}, 0
    for name, shape in params:
        numel = math.prod(shape)
        part = math.ceil(numel / world)
        if any(offset + part > f.numel() for f in flats):
            raise CheckpointError(f"{path}: parameter group {g} on some rank is too short for {name}")
        out[name] = torch.cat([f[offset : offset + part] for f in flats])[:numel].view(shape).clone()
        offset += part
    return out


__all__ = ["is_deepspeed_checkpoint", "latest_tag", "read_deepspeed_checkpoint"]
