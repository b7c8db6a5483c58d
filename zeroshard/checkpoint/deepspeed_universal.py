"""Reading DeepSpeed's universal checkpoint (the folder ``ds_to_universal`` writes, ``load_universal`` reads) into the
import's :class:`~.deepspeed_record.DeepSpeedCheckpoint`, then resumed by ``load_checkpoint`` (from memory) or
written as a zeroshard checkpoint like any DeepSpeed import. Writing one is :mod:`.universal_export`.

The layout, under ``<dir>/<tag>`` (``<dir>/latest_universal`` names the tag):

- ``mp_rank_00_model_states.pt`` (and under stage 3 ``zero_pp_rank_0_mp_rank_00_model_states.pt``): the engine's
  model states: parameter names and shapes per optimizer group, buffers, counters, scheduler, config, client state.
- ``zero/optimizer_state.pt``: the optimizer's hyperparameters (``param_groups``) and its ZeRO records.
- ``zero/<parameter>/fp32.pt`` and one ``<key>.pt`` per optimizer state tensor (``exp_avg``, ``exp_avg_sq`` for
  Adam; ``momentum_buffer``, ``sum``, ... for others): ``{"param": tensor, "cat_dim": 0}``, or a bare flat tensor
  (what the converter writes under stage 3); ``step.pt``: the step count (stages 1-2).

Every file is read with the restricted reader of ``--from-deepspeed`` (no code runs), and every parameter folder
must lie inside ``zero/``; a tensor-parallel, pipeline or AutoEP universal folder (merge records zeroshard does not
apply) is refused by name. A folder zeroshard wrote carries, in ``optimizer_state.pt`` under ``zeroshard``, what the
universal format has no place for (:mod:`.universal_export`); read back, it makes the round trip exact.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any, Optional

import torch

from .deepspeed_fields import dense, model_states, step_count
from .deepspeed_record import (
    ENGINE_KEYS,
    DeepSpeedCheckpoint,
    hyperparameters,
    imported_manifest,
    imported_tensors,
    plain_client_state,
    read_deepspeed_file,
    update_rule,
)
from .manifest import plain_name
from .reading import MemorySources, resolve_tag
from .safetensors_io import CheckpointError

LATEST_UNIVERSAL = "latest_universal"
MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
OWN_RECORD = "zeroshard"  # in optimizer_state.pt: what the universal format has no place for
_STATE_FILE = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\.pt")
# model states of a tensor-parallel rank above 0, of a pipeline stage, or of an expert layer
_PARALLEL_FILE = re.compile(
    r"(zero_pp_rank_\d+_)?mp_rank_(0[1-9]|[1-9]\d)\w*_model_states\.pt"
    r"|mp_rank_\d\d_\d{3}_model_states\.pt|layer_\w*_model_states\.pt"
)
# records of a tensor-parallel merge (Megatron's vocabulary padding, fused sub-parameters) and of AutoEP experts
_MERGE_RECORDS = ("vocab_tensor", "param_n_sub_params", "sub_param_shape", "ep_is_expert_param")


def is_universal_checkpoint(path: str) -> bool:
    """Whether ``path`` (a tag folder) holds a DeepSpeed universal checkpoint rather than a zeroshard manifest: its
    ``zero/`` folder of parameter folders (refused by name when ``zero/optimizer_state.pt`` is missing, so a half
    copied folder is not taken for DeepSpeed's rank files)."""
    zero = os.path.join(path, "zero")
    if os.path.exists(os.path.join(path, "manifest.json")) or not os.path.isdir(zero):
        return False
    if os.path.isfile(os.path.join(zero, "optimizer_state.pt")):
        return True
    with os.scandir(zero) as entries:
        parameters = any(e.is_dir() and os.path.isfile(os.path.join(e.path, "fp32.pt")) for e in entries)
    if parameters:
        raise CheckpointError(
            f"{path}: a DeepSpeed universal checkpoint without zero/optimizer_state.pt (the optimizer's "
            "hyperparameters and ZeRO records ds_to_universal writes beside the parameter folders): an incomplete "
            "copy or conversion; copy or convert it again. Nothing imported"
        )
    return False


def read_universal_checkpoint(ds_dir: str, tag: Optional[str] = None) -> DeepSpeedCheckpoint:
    """The universal folder ``ds_dir/tag`` (default: the tag ``latest_universal`` names), read and checked whole:
    per parameter its fp32 master and optimizer state, in parameter groups."""
    tag = resolve_tag(ds_dir, tag, LATEST_UNIVERSAL)
    if tag is None:
        raise CheckpointError(
            f"{ds_dir}: no '{LATEST_UNIVERSAL}' file; pass the universal folder's tag (e.g. global_step100_universal)"
        )
    path = os.path.join(ds_dir, tag)
    zero = os.path.join(path, "zero")
    if not os.path.isdir(zero):
        raise CheckpointError(f"{path}: not a DeepSpeed universal checkpoint (no zero/ folder of parameters)")
    if not is_universal_checkpoint(path):  # names a folder of parameters without zero/optimizer_state.pt
        raise CheckpointError(f"{path}: not a DeepSpeed universal checkpoint (no zero/optimizer_state.pt)")
    if any(_PARALLEL_FILE.fullmatch(f) for f in os.listdir(path)):
        raise CheckpointError(
            f"{path}: a tensor-, pipeline- or expert-parallel universal checkpoint (mp_rank_01 / layer files): its "
            "merge records (vocabulary padding, fused sub-parameters) are not applied here; nothing imported"
        )
    model_file = next((os.path.join(path, f) for f in MODEL_STATES if os.path.isfile(os.path.join(path, f))), None)
    if model_file is None:
        raise CheckpointError(f"{path}: no model states ({' or '.join(MODEL_STATES)})")
    model = read_deepspeed_file(model_file)
    states = model_states(model_file, model)
    optim_file = os.path.join(zero, "optimizer_state.pt")
    optim, groups_hyper, stage = _optimizer_state(optim_file, len(states.groups))
    own = _own_record(optim_file, optim.get(OWN_RECORD), len(states.groups))
    rule = own["type"] if own else update_rule(path, states.config, groups_hyper)
    masters: dict[str, torch.Tensor] = {}
    moments: dict[str, dict[str, torch.Tensor]] = {}
    steps = []
    for g, params in enumerate(states.groups):
        expected = own["state_keys"][g] if own and "state_keys" in own else None
        step = _read_group(zero, g, params, rule, own is not None, expected, masters, moments)
        steps.append(step if step is not None or own else _stage3_step(optim_file, optim, g))
    if own:
        hyper, steps = own["param_groups"], [None] * len(steps)
    else:
        hyper = [hyperparameters(path, g, dict(group), rule) for g, group in enumerate(groups_hyper)]
    return DeepSpeedCheckpoint(
        path=path,
        stage=stage,
        world_size=states.world,
        groups=states.groups,
        hyper=hyper,
        update_rule=rule,
        steps=steps,
        masters=masters,
        states=moments,
        counters=states.counters,
        config=states.config,
        lr_scheduler=states.lr_scheduler,
        buffers={**states.buffers, **_frozen_parameters(model_file, model, zero, states)},
        aliases=states.aliases,
        client_state={k: v for k, v in model.items() if k not in ENGINE_KEYS and k != "universal_checkpoint_info"},
        scalars=own["scalars"] if own else None,
    )


def _optimizer_state(path: str, groups: int) -> tuple[dict, list, int]:
    """``zero/optimizer_state.pt``: the whole record, its hyperparameters per group and the ZeRO stage, checked."""
    optim = read_deepspeed_file(path)
    groups_hyper = optim.get("param_groups") if isinstance(optim, dict) else None
    if not isinstance(groups_hyper, (list, tuple)) or len(groups_hyper) != groups:
        raise CheckpointError(
            f"{path}: field 'param_groups' is {type(groups_hyper).__name__}; expected {groups} parameter group(s), as "
            "the model states list"
        )
    if any(not isinstance(g, dict) for g in groups_hyper):
        raise CheckpointError(f"{path}: field 'param_groups' holds a non-dict; expected hyperparameter dicts")
    stage = optim.get("zero_stage", 1)
    if isinstance(stage, bool) or not isinstance(stage, int) or not 1 <= stage <= 3:
        raise CheckpointError(f"{path}: field 'zero_stage' is {stage!r}; expected 1, 2 or 3")
    return optim, list(groups_hyper), stage


def _read_group(
    zero: str,
    g: int,
    params: list,
    rule: Optional[str],
    own: bool,
    expected: Optional[list],
    masters: dict,
    moments: dict,
):
    """Parameter group ``g``'s folders into ``masters`` and ``moments`` (state key -> name -> tensor): the same state
    keys in every folder (``expected``: the keys zeroshard's record lists for the group), each tensor of its
    parameter's shape. Returns the group's step from ``step.pt`` (every folder must agree), or None where the
    converter wrote none (stage 3)."""
    keys, step = None, None
    for name, shape in params:
        folder = _parameter_folder(zero, name)
        found = _state_files(folder)
        if "fp32" not in found:
            raise CheckpointError(f"{folder}: no fp32.pt (the parameter's fp32 master); nothing imported")
        mine = sorted(set(found) - {"fp32", "step"})
        if keys is None:
            keys = mine
            _check_keys(folder, rule, keys, own, expected)
        elif mine != keys:
            raise CheckpointError(
                f"{folder}: optimizer state {mine}, but the other parameters of group {g} hold {keys}: a missing or "
                "foreign file; nothing imported"
            )
        masters[name] = _tensor(found["fp32"], shape, "fp32")
        for key in keys:
            moments.setdefault(key, {})[name] = _tensor(found[key], shape, key)
        if "step" in found:
            value = step_count(found["step"], "step", read_deepspeed_file(found["step"]))
            if step is not None and value != step:
                raise CheckpointError(f"{found['step']}: step {value}, other parameters of group {g} say {step}")
            step = value
    return step


def _frozen_parameters(path: str, model: dict, zero: str, states) -> dict[str, torch.Tensor]:
    """Parameters without optimizer state (a fine-tune's frozen base): named by ``frozen_param_shapes`` or present in
    the module's weights beside the trained ones. Each value comes from ``zero/<name>/fp32.pt`` where one exists (the
    file wins, also over a tensor the model states list among the buffers, as an export of a zeroshard checkpoint
    saved below stage 3 lists its frozen parameters), else from the module's weights; they load like buffers (whole,
    into the model). A weight in the module must be finite even where the file wins."""
    trained = {name for group in states.groups for name, _ in group}
    shapes = model.get("frozen_param_shapes") or {}
    module = model.get("module") or {}
    if not isinstance(shapes, dict):
        raise CheckpointError(f"{path}: field 'frozen_param_shapes' is {type(shapes).__name__}; expected a dict")
    out = {}
    for name in dict.fromkeys(n for n in [*shapes, *module] if n not in trained):
        value = module.get(name)
        folder = os.path.join(zero, plain_name(name, "parameter name", zero))
        from_file = os.path.isdir(folder) and "fp32" in _state_files(folder)
        if name in states.buffers and not from_file:
            continue  # a buffer: model_states read and checked it
        weights = dense(value) and value.is_floating_point() and value.numel() > 0
        if weights and not bool(torch.isfinite(value).all()):
            raise CheckpointError(f"{path}: field 'module[{name!r}]' holds NaN or inf")
        shape = tuple(shapes[name]) if name in shapes else tuple(getattr(value, "shape", ()))
        if from_file:
            out[name] = _tensor(_state_files(folder)["fp32"], shape, "fp32")
        elif weights and tuple(value.shape) == shape:
            out[name] = value.float()
        else:
            raise CheckpointError(
                f"{path}: frozen parameter {name!r} has neither zero/{name}/fp32.pt nor whole weights in 'module' "
                f"(found {type(value).__name__}); nothing imported"
            )
    return out


def _own_record(path: str, record: Any, groups: int) -> Optional[dict]:
    if record is None:
        return None
    keys = record.get("state_keys", [[]] * groups) if isinstance(record, dict) else None
    if (
        not isinstance(record, dict)
        or not isinstance(record.get("type"), (str, type(None)))
        or not isinstance(record.get("param_groups"), list)
        or not isinstance(record.get("scalars"), list)
        or len(record["param_groups"]) != groups
        or len(record["scalars"]) != groups
        or any(not isinstance(s, dict) for s in record["scalars"] + record["param_groups"])
        or not isinstance(keys, list)
        or len(keys) != groups
        or any(not isinstance(k, list) or not all(isinstance(x, str) for x in k) for k in keys)
    ):
        raise CheckpointError(f"{path}: field '{OWN_RECORD}' is not the record zeroshard writes; nothing imported")
    return record


def _parameter_folder(zero: str, name: str) -> str:
    """``zero/<name>``, which must be a folder directly inside ``zero/`` (no separators, no '..', no link out)."""
    plain_name(name, "parameter name", zero)
    folder = os.path.join(zero, name)
    if os.path.dirname(os.path.realpath(folder)) != os.path.realpath(zero):
        raise CheckpointError(f"{folder} links to {os.path.realpath(folder)}, outside the checkpoint's zero/ folder")
    if not os.path.isdir(folder):
        raise CheckpointError(f"{folder}: missing; the model states list parameter {name!r}")
    return folder


def _state_files(folder: str) -> dict[str, str]:
    out = {}
    for entry in sorted(os.listdir(folder)):
        match = _STATE_FILE.fullmatch(entry)
        if match is None:
            continue
        location = os.path.join(folder, entry)
        if os.path.dirname(os.path.realpath(location)) != os.path.realpath(folder) or not os.path.isfile(location):
            raise CheckpointError(f"{location} links outside its parameter folder (or is not a file): refused")
        out[match.group(1)] = location
    return out


def _check_keys(folder: str, rule: Optional[str], keys: list[str], own: bool, expected: Optional[list]) -> None:
    """The state files of a group's first folder are those its optimizer keeps: the ones zeroshard's record lists
    (``expected``), else Adam's two for an Adam checkpoint (a folder written before zeroshard recorded them too)."""
    if expected is not None:
        if keys != sorted(expected):
            missing = sorted(set(expected) - set(keys))
            raise CheckpointError(
                f"{folder}: optimizer state files {keys}, but the checkpoint's '{OWN_RECORD}' record lists "
                f"{sorted(expected)}: "
                + (f"missing {[k + '.pt' for k in missing]}" if missing else "foreign files")
                + "; nothing imported"
            )
        return
    if rule in ("Adam", "AdamW"):
        missing = [k for k in ("exp_avg", "exp_avg_sq") if k not in keys]
        extra = [k for k in keys if k not in ("exp_avg", "exp_avg_sq")]
        if missing or extra:
            raise CheckpointError(
                f"{folder}: the checkpoint ran Adam, whose state is exp_avg.pt and exp_avg_sq.pt; "
                + (f"missing {missing}" if missing else f"unexpected {extra} (amsgrad's max_exp_avg_sq?)")
                + "; nothing imported"
            )
    elif not keys and rule is None and not own:
        raise CheckpointError(f"{folder}: no optimizer state files besides fp32.pt and step.pt")


def _tensor(path: str, shape: tuple[int, ...], key: str) -> torch.Tensor:
    data = read_deepspeed_file(path)
    if isinstance(data, dict):
        marked = [k for k in _MERGE_RECORDS if data.get(k)]
        if marked:
            raise CheckpointError(f"{path}: records {marked} of a tensor-parallel / expert merge: not importable")
        if data.get("cat_dim", 0) not in (0, 1):
            raise CheckpointError(f"{path}: field 'cat_dim' is {data.get('cat_dim')!r}; expected 0 or 1")
        data = data.get("param")
    if not dense(data) or not data.is_floating_point():
        shown = f"{type(data).__name__}" + (f" {data.dtype}" if torch.is_tensor(data) else "")
        raise CheckpointError(f"{path}: holds {shown}; expected a dense floating-point tensor ('param')")
    if data.numel() != math.prod(shape) or (data.dim() > 1 and tuple(data.shape) != tuple(shape)):
        raise CheckpointError(
            f"{path}: a tensor of shape {list(data.shape)}, but the model states give the parameter shape "
            f"{list(shape)}: a file of another model; nothing imported"
        )
    values = data.float().reshape(shape).clone()
    if not bool(torch.isfinite(values).all()):
        raise CheckpointError(f"{path}: holds NaN or inf")
    if key == "exp_avg_sq" and bool((values < 0).any()):
        raise CheckpointError(f"{path}: negative values; Adam's second moment is a mean of squares (an edited file?)")
    return values


def _stage3_step(path: str, optim: dict, g: int) -> float:
    """Stage 3's converter writes no step.pt: DeepSpeed takes the step from rank 0's optimizer state, group 0."""
    inner = optim.get("optimizer_state_dict")
    state = inner.get("state") if isinstance(inner, dict) else None
    record = state.get(g, state.get(0)) if isinstance(state, dict) else None
    if not isinstance(record, dict) or "step" not in record:
        raise CheckpointError(f"{path}: no step.pt in the parameter folders and no 'optimizer_state_dict.state' step")
    return step_count(path, "optimizer_state_dict.state.step", record["step"])


def universal_sources(ds_dir: str, tag: str) -> tuple[dict, MemorySources]:
    """The universal folder ``ds_dir/tag`` as ``load_checkpoint`` reads a checkpoint: a manifest (as the import
    writes one) and its tensors, held in memory."""
    return in_memory(read_universal_checkpoint(ds_dir, tag), tag)


def in_memory(source: DeepSpeedCheckpoint, tag: str) -> tuple[dict, MemorySources]:
    """An imported checkpoint as ``load`` reads one: its manifest and its tensors, served from memory."""
    client, client_tensors = plain_client_state(source.client_state)
    tensors, params = imported_tensors(source, client_tensors)
    manifest = imported_manifest(source, tag, client, client_tensors, params, files={})
    return manifest, MemorySources(source.path, manifest, dict(tensors))


__all__ = [
    "LATEST_UNIVERSAL",
    "in_memory",
    "is_universal_checkpoint",
    "read_universal_checkpoint",
    "universal_sources",
]
