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
import json
import math
import os
import re
import shutil
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from .client_state import json_ready, split_client_state
from .commit import atomic_write_text, commit
from .deepspeed_fields import STATE_KEYS as _STATE_KEYS
from .deepspeed_fields import (
    RankRecord,
    agreed_stage,
    agreed_step,
    check_same_hyperparameters,
    model_states,
    rank_record,
)
from .deepspeed_ranks import check_partitions, check_stage3_pieces
from .manifest import FORMAT, plain_name, rank_file, seal
from .reading import resolve_tag
from .restricted_pickle import read_restricted_pickle
from .safetensors_io import CheckpointError, write


class LossScalerRecord:
    """The attributes of DeepSpeed's ``LossScaler`` / ``DynamicLossScaler`` (``cur_scale``, ``dynamic``, ...)."""


class FragmentAddress:
    """DeepSpeed's ``fragment_address`` (``numel``, ``start``): where a parameter lies in a rank's partition."""


class ZeroStage(int):
    """DeepSpeed's ``ZeroStageEnum``: the stage number."""


DEEPSPEED_CLASSES = [
    (LossScalerRecord, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (LossScalerRecord, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
    (ZeroStage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
]

# the model-states keys DeepSpeed writes itself; every other top-level key is the client's state
_ENGINE_KEYS = {
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version",
    "checkpoint_parallel_dimensions", "autoep_layers", "compression_scheduler", "ds_autotp_meta",
}  # fmt: skip
# how torch ran the optimizer (kernels), not what it trains with: the importing run chooses its own
_IMPLEMENTATION_KEYS = {"foreach", "fused", "capturable", "differentiable"}


def read_deepspeed_file(path: str) -> Any:
    """One of DeepSpeed's ``.pt`` files, unpickled with tensors, containers, plain values and DeepSpeed's checkpoint
    classes (as stand-ins) only: anything else is a :class:`CheckpointError` naming it, and nothing of it runs."""
    return read_restricted_pickle(
        path,
        "a DeepSpeed checkpoint holds tensors, containers, plain values and DeepSpeed's loss-scaler / fragment-address "
        "/ ZeRO-stage records only",
        DEEPSPEED_CLASSES,
    )


@dataclass
class DeepSpeedCheckpoint:
    """A DeepSpeed checkpoint read whole: per parameter its fp32 master and optimizer state, in parameter groups."""

    path: str
    stage: int
    world_size: int
    groups: list[list[tuple[str, tuple[int, ...]]]]  # per parameter group: (name, shape) in DeepSpeed's order
    hyper: list[dict]  # per parameter group: its hyperparameters (lr, betas, ...), in zeroshard's vocabulary
    update_rule: Optional[str]  # "AdamW" / "Adam" where the files say which; None for other optimizers
    steps: list[Any]  # per parameter group: the optimizer's step count
    masters: dict[str, torch.Tensor]
    states: dict[str, dict[str, torch.Tensor]]  # state key -> name -> tensor
    counters: dict[str, int]
    config: dict
    lr_scheduler: Optional[dict]
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    client_state: dict = field(default_factory=dict)
    scalars: Optional[list[dict]] = None  # per parameter group, the manifest's scalar records (else the step)


def is_deepspeed_checkpoint(directory: str) -> bool:
    """Whether ``directory`` (or its ``latest`` tag) holds DeepSpeed's files rather than a zeroshard manifest."""
    for where in (directory, os.path.join(directory, _latest(directory) or "")):
        if glob.glob(os.path.join(where, "*mp_rank_00_model_states.pt")):
            return True
    return False


def _latest(directory: str) -> Optional[str]:
    try:
        with open(os.path.join(directory, "latest")) as f:
            return plain_name(f.read().strip(), "tag in 'latest'", directory)
    except (OSError, UnicodeDecodeError):
        return None


def read_deepspeed_checkpoint(ds_dir: str, tag: Optional[str] = None) -> DeepSpeedCheckpoint:
    tag = tag if tag is not None else _latest(ds_dir)
    if tag is None:
        raise CheckpointError(f"{ds_dir}: no 'latest' file; pass the tag (the step directory's name) with --tag")
    path = os.path.join(ds_dir, plain_name(tag, "tag", ds_dir))
    model_files = sorted(glob.glob(os.path.join(path, "*mp_rank_*_model_states.pt")))
    if not model_files:
        raise CheckpointError(f"{path}: no DeepSpeed model states (mp_rank_00_model_states.pt) here")
    if any(not re.search(r"mp_rank_00_model_states\.pt$", f) for f in model_files):
        raise CheckpointError(f"{path}: a tensor-parallel DeepSpeed checkpoint (mp_rank_01...) is not importable")
    model = read_deepspeed_file(model_files[0])
    if isinstance(model, dict) and (model.get("frozen_param_shapes") or model.get("frozen_param_fragments")):
        raise CheckpointError(f"{path}: frozen parameters in a DeepSpeed checkpoint are not importable yet")
    states = model_states(model_files[0], model)
    world, groups = states.world, states.groups
    present = len(glob.glob(os.path.join(path, "*zero_pp_rank_*_mp_rank_00_optim_states.pt")))
    if present > world:
        raise CheckpointError(
            f"{path}: {present} ranks' optimizer files, but the model states say dp_world_size {world}: files of "
            "different runs"
        )
    ranks = [rank_record(*_optim_file(path, rank), groups) for rank in range(world)]
    stage = agreed_stage(path, ranks)
    check_same_hyperparameters(path, ranks)
    inner, base = [r.inner for r in ranks], [r.base for r in ranks]
    update_rule = _update_rule(path, states.config, base[0]["param_groups"])
    if stage < 3:
        check_partitions(path, groups, inner, world)
    else:
        check_stage3_pieces(path, groups, inner, base, world, update_rule)
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
        hyper=[_hyperparameters(path, g, group, update_rule) for g, group in enumerate(base[0]["param_groups"])],
        update_rule=update_rule,
        steps=[agreed_step(path, ranks, g) for g in range(len(groups))],
        masters=masters,
        states=moments,
        counters=states.counters,
        config=states.config,
        lr_scheduler=states.lr_scheduler,
        buffers=states.buffers,
        aliases=states.aliases,
        client_state={k: v for k, v in model.items() if k not in _ENGINE_KEYS},
    )


def _update_rule(path: str, config: dict, param_groups: list[dict]) -> Optional[str]:
    """Adam's update rule as DeepSpeed ran it. With an ``optimizer`` block DeepSpeed decides as its engine does:
    ``"AdamW"``, or ``"Adam"`` with ``adam_w_mode`` (default true, for FusedAdam, DeepSpeedCPUAdam and torch's
    Adam alike), decays weights decoupled. A client's optimizer says so in its groups (torch's
    ``decoupled_weight_decay``); DeepSpeed's own Adams (``bias_correction`` in their groups) default to AdamW."""
    block = config.get("optimizer")
    if isinstance(block, dict) and isinstance(block.get("type"), str):
        name = block["type"].lower()
        if name not in ("adam", "adamw"):
            return None
        params = block.get("params") if isinstance(block.get("params"), dict) else {}
        adam_w_mode = params.get("adam_w_mode", True)
        if not isinstance(adam_w_mode, bool):
            raise CheckpointError(f"{path}: ds_config field 'optimizer.params.adam_w_mode' is {adam_w_mode!r}")
        return "AdamW" if name == "adamw" or adam_w_mode else "Adam"
    first = param_groups[0] if param_groups else {}
    if isinstance(first.get("decoupled_weight_decay"), bool):
        return "AdamW" if first["decoupled_weight_decay"] else "Adam"
    if "bias_correction" in first:
        warnings.warn(
            f"{path}: a client optimizer of DeepSpeed's (FusedAdam / DeepSpeedCPUAdam) without an 'optimizer' config "
            "block: imported as AdamW (their adam_w_mode default); pass the config's optimizer to resume as Adam",
            stacklevel=4,
        )
        return "AdamW"
    return None


def _hyperparameters(path: str, g: int, group: dict, update_rule: Optional[str]) -> dict:
    """One parameter group's hyperparameters as zeroshard's optimizer names them. DeepSpeed's Adams add
    ``bias_correction`` (always on here: off is refused) and a group ``step`` (a counter, read by :func:`_step`);
    Adam or AdamW becomes torch's ``decoupled_weight_decay``, the flag zeroshard's Adams hold."""
    hyper = {k: v for k, v in group.items() if k != "params" and k not in _IMPLEMENTATION_KEYS}
    if update_rule is None:
        return hyper
    if hyper.pop("bias_correction", True) is not True:
        raise CheckpointError(
            f"{path}: parameter group {g} ran Adam with bias_correction false, which zeroshard's Adam does not "
            "implement (it always corrects the moments' bias)"
        )
    if hyper.get("amsgrad"):
        raise CheckpointError(
            f"{path}: parameter group {g} ran Adam with amsgrad; its max_exp_avg_sq state is not importable"
        )
    hyper.pop("step", None)
    hyper["decoupled_weight_decay"] = update_rule == "AdamW"
    return hyper


def _optim_file(path: str, rank: int) -> tuple[str, Any]:
    for prefix in ("", "bf16_"):
        candidate = os.path.join(path, f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
        if os.path.exists(candidate):
            return candidate, read_deepspeed_file(candidate)
    raise CheckpointError(
        f"{path}: rank {rank}'s optimizer states (zero_pp_rank_{rank}_mp_rank_00_optim_states.pt) are missing; the "
        "model states say the checkpoint was written by more ranks"
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


def convert_deepspeed_checkpoint(ds_dir: str, out_dir: str, tag: Optional[str] = None) -> str:
    """``zeroshard convert --from-deepspeed``: write DeepSpeed's checkpoint ``ds_dir`` (tag ``tag`` or its
    ``latest``; a universal folder, or ``latest_universal`` where there is no ``latest``) as a zeroshard checkpoint
    under ``out_dir`` (same tag; ``latest`` set). Returns its directory."""
    from .deepspeed_universal import LATEST_UNIVERSAL, is_universal_checkpoint, read_universal_checkpoint

    named = tag if tag is not None else _latest(ds_dir)
    if named is None and resolve_tag(ds_dir, None, LATEST_UNIVERSAL) is not None:
        source = read_universal_checkpoint(ds_dir)
    elif named is not None and is_universal_checkpoint(os.path.join(ds_dir, plain_name(named, "tag", ds_dir))):
        source = read_universal_checkpoint(ds_dir, named)
    else:
        source = read_deepspeed_checkpoint(ds_dir, tag)
    tag = os.path.basename(source.path)
    final, tmp = os.path.join(out_dir, tag), os.path.join(out_dir, f".{tag}.tmp")
    if os.path.exists(final):
        raise CheckpointError(f"{final} exists; convert into another directory (nothing was replaced)")
    client, client_tensors = plain_client_state(source.client_state)
    os.makedirs(out_dir, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        _write(source, tmp, tag, client, client_tensors)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    commit(out_dir, tag, save_latest=True, keep_replaced=False)
    return final


def plain_client_state(state: dict) -> tuple[dict, dict]:
    """DeepSpeed's client state split as a zeroshard manifest holds it; what is not plain data is warned about and
    left out."""
    kept, dropped = {}, []
    for key, value in state.items():
        try:
            split_client_state({key: value})
            kept[key] = value
        except TypeError:
            dropped.append(key)
    if dropped:
        warnings.warn(f"client state {dropped} is not plain data (JSON and tensors): left out", stacklevel=3)
    return split_client_state(kept)


def _write(source: DeepSpeedCheckpoint, tmp: str, tag: str, client: dict, client_tensors: dict) -> None:
    tensors, params = imported_tensors(source, client_tensors)
    file = rank_file(0)
    written = write(os.path.join(tmp, file), iter(tensors), [(n, t.dtype, tuple(t.shape)) for n, t in tensors])
    files = {file: {"size": os.path.getsize(os.path.join(tmp, file)), "header_crc": written.header_crc,
                    "crc": written.crcs}}  # fmt: skip
    manifest = imported_manifest(source, tag, client, client_tensors, params, files)
    atomic_write_text(os.path.join(tmp, "manifest.json"), json.dumps(seal(manifest)))


def imported_tensors(source: DeepSpeedCheckpoint, client_tensors: dict) -> tuple[list, dict]:
    """The import's tensors as rank 0's file holds them (one flat group per parameter group: masters and each
    optimizer state), and the manifest's ``params`` entries that point into them."""
    tensors: list[tuple[str, torch.Tensor]] = []
    params: dict[str, dict] = {}
    file = rank_file(0)
    for g, group in enumerate(source.groups):
        offset = 0
        for name, shape in group:
            numel = math.prod(shape)
            params[name] = {"pieces": [[file, f"fg{g}", offset, 0, numel]], "shape": list(shape), "dtype": "float32"}
            offset += numel
        tensors.append((f"master.fg{g}", torch.cat([source.masters[n].reshape(-1) for n, _ in group])))
        for key in _group_keys(source, group):
            tensors.append((f"optim.{key}.fg{g}", torch.cat([source.states[key][n].reshape(-1) for n, _ in group])))
    tensors += [(f"module.{n}", t.contiguous()) for n, t in source.buffers.items()]
    tensors += [(n, t.contiguous()) for n, t in client_tensors.items()]
    return tensors, params


def _group_keys(source: DeepSpeedCheckpoint, group: list) -> list[str]:
    return [key for key, values in source.states.items() if group and group[0][0] in values]


def imported_manifest(
    source: DeepSpeedCheckpoint, tag: str, client: dict, client_tensors: dict, params: dict, files: dict
) -> dict:
    """The zeroshard manifest of an imported checkpoint (unsealed), its tensors as :func:`imported_tensors`
    lays them out in ``files``."""
    file = rank_file(0)
    entry = lambda n, t, key: {"file": file, "key": key, "shape": list(t.shape), "dtype": str(t.dtype)[6:]}  # noqa: E731
    step = lambda value: {"step": {"value": value, "tensor": True, "dtype": "float32"}}  # noqa: E731
    return {
        "format": FORMAT,
        "tag": tag,
        "world_size": source.world_size,
        "stage": source.stage,
        "shard_group_size": source.world_size,
        "counters": {**source.counters, "micro_steps": source.counters["global_steps"]},
        "loss_scaler": None,
        "lr_scheduler": json_ready(source.lr_scheduler, "the DeepSpeed checkpoint's lr_scheduler"),
        "optimizer": {
            **({"type": source.update_rule} if source.update_rule else {}),
            "param_groups": json_ready(source.hyper, "the DeepSpeed checkpoint's optimizer hyperparameters"),
            "flat_groups": [
                {
                    "group": g,
                    "state_keys": _group_keys(source, group),
                    "scalars": source.scalars[g] if source.scalars is not None else step(source.steps[g]),
                }
                for g, group in enumerate(source.groups)
            ],
        },
        "params": params,
        "module_tensors": {n: entry(n, t, f"module.{n}") for n, t in source.buffers.items()},
        "files": files,
        "python_rng": {},
        "aliases": {a: t for a, t in source.aliases.items() if t in params},
        "config": json_ready(source.config, "the DeepSpeed checkpoint's ds_config"),
        "client_state": client,
        "client_tensors": {n: entry(n, t, n) for n, t in client_tensors.items()},
        "imported_from": {"deepspeed": source.path, "world_size": source.world_size, "stage": source.stage},
    }


__all__ = [
    "DeepSpeedCheckpoint",
    "convert_deepspeed_checkpoint",
    "is_deepspeed_checkpoint",
    "read_deepspeed_file",
]
