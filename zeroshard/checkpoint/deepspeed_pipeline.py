"""DeepSpeed's pipeline checkpoints, read as one model: the parts only pipelines have.

DeepSpeed's pipeline engine saves each stage as a ZeRO checkpoint of its own, told apart by the model-parallel rank
(``mp_rank_XX_model_states.pt`` for stage XX, ``[bf16_]zero_pp_rank_D_mp_rank_XX_optim_states.pt`` for its data-
parallel rank D), with ``module: None``: the weights go to one file per layer, ``layer_XX-model_states.pt``, XX the
layer's index in the whole model (a tied module once, under its first layer's index). Parameter names are the
stage module's, which are the whole model's (``"3.fc.weight"``, ``"tied_modules.embed.weight"``), so the stages
join by name: each stage's optimizer partitions give its parameters' fp32 masters and Adam state, and a tied
parameter, which every stage holding it saves, must be the same on each (its gradient was summed over them).
Layer files with a model-parallel part (``layer_XX-model_YY-model_states.pt``: tensor parallelism inside the
stages) are refused by name.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re

import torch

from .deepspeed_record import DeepSpeedCheckpoint, read_deepspeed_file
from .safetensors_io import CheckpointError

_LAYER = re.compile(r"layer_(\d+)-model_states\.pt")
_SPLIT_LAYER = re.compile(r"layer_\d+-model_\d+-model_states\.pt")


def layer_files(path: str) -> dict[int, str]:
    """The layer files of a pipeline checkpoint in ``path`` by layer index ({} for any other checkpoint)."""
    names = [os.path.basename(f) for f in glob.glob(os.path.join(path, "layer_*model_states.pt"))]
    split = [n for n in names if _SPLIT_LAYER.fullmatch(n)]
    if split:
        raise CheckpointError(
            f"{path}: {split[0]} is a layer of a pipeline with tensor parallelism inside its stages, which is not "
            "importable yet"
        )
    layers = {}
    for name in names:
        match = _LAYER.fullmatch(name)
        if match is None:
            raise CheckpointError(f"{path}: {name} is no DeepSpeed layer file (layer_XX-model_states.pt)")
        layers[int(match.group(1))] = os.path.join(path, name)
    return layers


def stage_buffers(path: str, model: dict, layers: dict[int, str]) -> dict:
    """A stage's buffers (its model states' ``buffer_names``, ``"<layer>.<name>"``) read from their layer files, as
    the module dict :func:`~.deepspeed_fields.model_states` reads them from; first every layer file the stage's
    parameters name is checked to hold them at their shapes (a missing file, or one of another model, is named)."""
    shapes = model.get("param_shapes") if isinstance(model.get("param_shapes"), (list, tuple)) else []
    wanted = {name: tuple(shape) for group in shapes if isinstance(group, dict) for name, shape in group.items()}
    names = model.get("buffer_names") if isinstance(model.get("buffer_names"), (list, tuple)) else []
    by_layer: dict[int, list] = {}
    for name in [*wanted, *names]:
        match = re.fullmatch(r"(\d+)\.(.+)", name) if isinstance(name, str) else None
        if match is not None:
            by_layer.setdefault(int(match.group(1)), []).append((name, match.group(2)))
        elif name in names:
            raise CheckpointError(f"{path}: the buffer {name!r} is in no layer file (a tied module's buffers are not "
                                  "importable yet)")  # fmt: skip
    module = {}
    for index, entries in sorted(by_layer.items()):
        if index not in layers:
            raise CheckpointError(f"{path}: layer_{index:02d}-model_states.pt is missing (it holds {entries[0][0]})")
        saved = read_deepspeed_file(layers[index])
        for name, key in entries:
            value = saved.get(key) if isinstance(saved, dict) else None
            if not torch.is_tensor(value) or (name in wanted and tuple(value.shape) != wanted[name]):
                raise CheckpointError(
                    f"{path}: {os.path.basename(layers[index])} holds {key!r} as "
                    f"{tuple(value.shape) if torch.is_tensor(value) else type(value).__name__}, the stage's model "
                    f"states say {name} is {wanted.get(name, 'a buffer')}: a layer file of another model"
                )
            if name in names:
                module[name] = value
    return module


def join_stages(path: str, stages: list[DeepSpeedCheckpoint]) -> DeepSpeedCheckpoint:
    """The stages' checkpoints as one model's: their parameters joined group by group in stage order, a tied
    parameter once (its copies checked equal), the counters, hyperparameters and steps the stages agree on."""
    first = stages[0]
    for index, stage in enumerate(stages[1:], start=1):
        for what in ("stage", "world_size", "update_rule", "counters", "hyper", "steps"):
            if getattr(stage, what) != getattr(first, what):
                raise CheckpointError(
                    f"{path}: pipeline stage {index}'s files say {what} {getattr(stage, what)!r}, stage 0's "
                    f"{getattr(first, what)!r}: files of different runs"
                )
        if len(stage.groups) != len(first.groups):
            raise CheckpointError(f"{path}: pipeline stage {index} has {len(stage.groups)} parameter groups, stage 0 "
                                  f"{len(first.groups)}")  # fmt: skip
    groups = [[] for _ in first.groups]
    masters, states = {}, {key: {} for key in first.states}
    for index, stage in enumerate(stages):
        for g, params in enumerate(stage.groups):
            for name, shape in params:
                if name in masters:
                    _check_tied_copy(path, index, name, stage, masters, states)
                    continue
                groups[g].append((name, shape))
                masters[name] = stage.masters[name]
                for key in states:
                    states[key][name] = stage.states[key][name]
    buffers, aliases = {}, {}
    for stage in stages:
        buffers.update(stage.buffers)
        aliases.update(stage.aliases)
    return dataclasses.replace(first, groups=groups, masters=masters, states=states, buffers=buffers, aliases=aliases)


def _check_tied_copy(path: str, index: int, name: str, stage: DeepSpeedCheckpoint, masters: dict, states: dict):
    """A parameter two stages hold (a tied module) must be the same on both, state included."""
    same = torch.equal(stage.masters[name], masters[name]) and all(
        torch.equal(stage.states[key][name], states[key][name]) for key in states
    )
    if not same:
        raise CheckpointError(
            f"{path}: the tied parameter {name} differs between pipeline stage {index} and an earlier stage "
            "(DeepSpeed sums a tied module's gradients over its stages, so the copies are equal): files of different "
            "runs, or an edited file; nothing imported"
        )


__all__ = ["join_stages", "layer_files", "stage_buffers"]
