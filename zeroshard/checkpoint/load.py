"""Loading a checkpoint saved at any world size and stage into an engine's training state (see ``save.py`` for the
format): everything is read and verified before anything collective happens, then the ranks agree
(``agreement.py``); :func:`load` returns what it restored."""

from __future__ import annotations

import math
import os
import random
import warnings
from typing import Any, NamedTuple, Optional

import torch

from .. import comm
from ..log import log_rank0
from .agreement import agree_on_load
from .client_state import read_client_tensors, restore_client_state
from .deepspeed_import import is_deepspeed_checkpoint, read_deepspeed_checkpoint
from .deepspeed_universal import LATEST_UNIVERSAL, in_memory, is_universal_checkpoint, universal_sources
from .manifest import rank_file, saved_split
from .piece_reader import PieceReader
from .reading import Sources, read_manifest, resolve_tag, scalar_value
from .safetensors_io import DTYPES, CheckpointError
from .save import COMPRESSION, outside_tensors
from .view import TrainingState


class Restored(NamedTuple):
    """What :func:`load` restored: the checkpoint's path (None: nothing to load), its client state, and one line per
    part restored beyond the weights (counters, loss scale, optimizer, scheduler, sampler, RNG, ...)."""

    path: Optional[str]
    client_state: Optional[dict]
    restored: list[str]


def _load_module_tensors(state: TrainingState, manifest: dict, sources, read: PieceReader, unexpected) -> None:
    """The buffers, and the parameters outside the flat groups (frozen ones below stage 3)."""
    in_flats = {id(p) for f in [*state.flat_groups, *state.frozen_groups] for p in f.params}
    parameters = {read.saved_name(n) for n, _ in state.module.named_parameters()}
    experts = {name for names in state.expert_names.values() for name in names}  # every expert rank's
    for name, entry in manifest["module_tensors"].items():  # buffers; parameters are read below
        if name not in unexpected and name not in parameters and name not in experts and state.holds(name):
            target = _module_tensor(state.module, name)
            if target is not None:
                target.copy_(sources.read_whole(name, entry))
    for name, param in state.module.named_parameters():
        if id(param) not in in_flats and read.saved(name):
            read(name, "master", 0, param.numel(), param.data.view(-1))


def load(
    state: TrainingState,
    load_dir: str,
    tag: Optional[str] = None,
    load_module_strict: bool = True,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
    universal: bool = False,
) -> Restored:
    """Every rank calls it. Returns what it restored (``path`` None when there is nothing to load). With
    ``universal`` (the config's ``checkpoint.load_universal``) the tag defaults to the one ``latest_universal``
    names, and that may be a zeroshard checkpoint or a DeepSpeed universal folder (read in memory, checked whole
    before anything is restored)."""
    checks_optimizer = state.optimizer is not None and load_optimizer_states and not load_module_only
    checked = _open_and_check(state, load_dir, tag, universal, load_module_strict, checks_optimizer)
    if checked is None:
        warnings.warn(f"no checkpoint to load in {load_dir} (no 'latest' file); starting from scratch", stacklevel=3)
        return Restored(None, None, [])
    (path, manifest, sources), (missing, unexpected) = checked
    zero = state.optimizer
    error: Optional[CheckpointError] = None
    report: list[str] = []
    client_state, compression = None, {}
    try:  # reading and verifying issues no collective, so a rank that fails cannot strand the others
        with torch.no_grad():
            read = PieceReader(sources, state)
            for k, flat in enumerate(state.flat_groups):
                _load_flat(zero, k, flat, manifest, read, load_optimizer_states and not load_module_only)
            for flat in state.frozen_groups:
                _load_frozen(flat, manifest, read)
            _load_module_tensors(state, manifest, sources, read, unexpected)
            client_state = restore_client_state(manifest["client_state"], read_client_tensors(sources, manifest))
            if not load_module_only:
                report = _load_training_state(state, manifest, sources, load_optimizer_states, load_lr_scheduler_states)
                if zero is not None and load_optimizer_states:
                    compression = _compression_state(state, manifest, sources)
    except CheckpointError as err:
        error = err
    finally:
        sources.close()
    agree_on_load(state.mesh.world, error, path)
    if missing or unexpected:
        report.append(
            f"load_module_strict=False: kept as initialized (not in the checkpoint) {missing}; "
            f"ignored (not in the model) {unexpected}"
        )
    log_rank0(f"load_checkpoint {path}: " + "; ".join(report or ["module weights restored"]))
    if zero is not None:
        with torch.no_grad():
            zero.publish()  # the compute parameters follow the loaded master weights
        if compression:
            restored = zero.load_compression_state(compression)
            log_rank0(
                "load_checkpoint: 1-bit compression errors and momentum restored (same layout: the resume is exact)"
                if restored
                else "load_checkpoint: 1-bit compression state reset (saved at another layout; the exchange restarts "
                "from the loaded exp_avg with zero errors, as DeepSpeed does on every load)"
            )
    return Restored(path, None if load_module_only else client_state, report)


def _open_and_check(
    state: TrainingState, load_dir: str, tag: Optional[str], universal: bool, strict: bool, checks_optimizer: bool
) -> Optional[tuple]:
    """((path, manifest, sources), (missing, unexpected)) of the checkpoint to load, checked against this rank's
    state, or None when ``load_dir`` names none. One verdict for every rank: a pipeline stage can fail the name check
    alone, a node can lack the directory."""
    opened, error = None, None
    try:
        opened = _open(state, load_dir, tag, universal)
        if opened is not None:
            path, manifest, _ = opened
            names = _check_params(state, manifest, strict)
            _check_split_records(state, manifest, path)
            if checks_optimizer:
                _check_optimizer(state.optimizer, manifest, path)
    except CheckpointError as err:
        error = err
        if opened is not None:
            opened[2].close()
    agree_on_load(state.mesh.world, error, load_dir, found=opened is not None)
    return None if opened is None else (opened, names)


def _open(state: TrainingState, load_dir: str, tag: Optional[str], universal: bool) -> Optional[tuple]:
    """(path, manifest, sources) of the checkpoint to load, or None when ``load_dir`` names none; DeepSpeed's ZeRO
    and pipeline files are read in memory as ``zeroshard convert --from-deepspeed`` reads them (every rank reads
    them; ``load`` agrees on the verdict)."""
    tag = resolve_tag(load_dir, tag, LATEST_UNIVERSAL if universal else "latest")
    if tag is None:
        if universal:
            raise CheckpointError(
                f"{load_dir}: no '{LATEST_UNIVERSAL}' file (checkpoint.load_universal is set): pass the tag, or save "
                "with load_universal set (zeroshard then writes it beside 'latest'), or write a universal folder with "
                "DeepSpeed's ds_to_universal / `zeroshard convert CK OUT --to deepspeed-universal`"
            )
        return None
    path = os.path.join(load_dir, tag)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    if is_universal_checkpoint(path):
        if not universal:
            raise CheckpointError(
                f'{path} is a DeepSpeed universal checkpoint: set "checkpoint": {{"load_universal": true}} to resume '
                f"it directly, or import it once with `zeroshard convert --from-deepspeed {load_dir} OUT_DIR --tag "
                f"{tag}`"
            )
        manifest, sources = universal_sources(load_dir, tag)  # every rank reads it; load() agrees on the verdict
        return path, manifest, sources
    if not os.path.exists(os.path.join(path, "manifest.json")) and is_deepspeed_checkpoint(path):
        # DeepSpeed's own files (ZeRO ranks, or a pipeline's stages and layer files), read as the import reads them
        manifest, sources = in_memory(read_deepspeed_checkpoint(load_dir, tag), tag)
        return path, manifest, sources
    manifest = read_manifest(path)
    return path, manifest, Sources(path, manifest)


def _check_params(state: TrainingState, manifest: dict, strict: bool) -> tuple[list[str], list[str]]:
    """Shapes must match (whole parameters: tensor-parallel pieces at any degree); with ``strict`` the names too (a
    pipeline stage's: the checkpoint holds the other stages' as well). Returns (missing from the checkpoint, not in
    the model)."""
    splits, experts = state.tensor_splits, state.expert_names
    mine = {  # tied aliases appear once
        n: splits[n].full_shape(tuple(p.shape)) if n in splits else tuple(p.shape)
        for n, p in state.module.named_parameters()
        if n not in experts
    }
    for n, p in state.module.named_parameters():  # every expert of every expert rank, by its global name
        mine.update({name: tuple(p.shape) for name in experts.get(n, ())})
    saved = {n: tuple(e["shape"]) for n, e in manifest["params"].items()}
    saved.update({n: tuple(e["shape"]) for n, e in manifest["module_tensors"].items()})
    mine.update({n.removeprefix("module."): tuple(t.shape) for n, t in outside_tensors(state).items()})
    wrong = [f"{n}: checkpoint {saved[n]} vs model {s}" for n, s in mine.items() if n in saved and saved[n] != s]
    missing = sorted(set(mine) - set(saved) - set(manifest.get("excluded_frozen", [])))
    unexpected = sorted(n for n in set(saved) - set(mine) if state.holds(n))  # not other pipeline stages' names
    if not (wrong or (strict and (missing or unexpected))):
        return missing, unexpected
    raise CheckpointError(
        "checkpoint does not match the model: "
        + "; ".join(
            filter(
                None,
                [
                    f"shape mismatch {wrong}" if wrong else "",
                    f"missing from checkpoint {missing}" if missing else "",
                    f"not in model {unexpected}" if unexpected else "",
                ],
            )
        )
    )


def _check_split_records(state: TrainingState, manifest: dict, path: str) -> None:
    """Each saved split record (and each record's absence) must be how this model cuts that parameter at the
    saved degree (:func:`~zeroshard.tensor_parallel.splits_at`): the pieces are joined by the record, so an edited
    ``dim`` / ``fused`` / ``transposed`` or a deleted record would load other weights without a word."""
    saved_tp = manifest.get("tensor_parallel_size", 1)
    if saved_tp == 1 or state.splits_at is None:
        return
    try:
        expected = state.splits_at(saved_tp)
    except ValueError:  # this model cannot be split at that degree: the shapes check speaks for it
        return
    for name, entry in manifest["params"].items():
        saved, mine = saved_split(entry), expected.get(name)
        if saved is not None and saved.axis != "tp":
            continue  # an expert split: the manifest checks it (dim 0, no fusion, the saved expert degree)
        if saved != mine:
            said = saved.as_record() if saved is not None else "no split (whole)"
            want = mine.as_record() if mine is not None else "no split (replicated)"
            raise CheckpointError(
                f"{path}: field 'params.{name}.split' is {said}, but this model cuts '{name}' over {saved_tp} "
                f"tensor-parallel ranks as {want}: an edited record, or a run that placed layers otherwise (load "
                "with the tensor_parallel block it was saved with)"
            )


def _check_optimizer(zero, manifest: dict, path: str) -> None:
    """The saved optimizer state must be this optimizer's: the same update rule, and hyperparameters of the types
    this optimizer holds (checked before anything is restored, so a refused load changes nothing)."""
    saved = manifest["optimizer"]
    groups = saved["param_groups"]
    advice = "; pass load_optimizer_states=False to load the weights (and counters) only"
    if saved.get("type") is not None and saved["type"] != zero.kind:
        raise CheckpointError(
            f"{path}: the checkpoint holds {saved['type']} optimizer state, this engine's optimizer is {zero.kind}"
            + advice
        )
    mine = [{k: v for k, v in g.items() if k != "params"} for g in zero.param_groups]
    if saved.get("type") is None and groups and mine:  # older checkpoints: tell optimizers apart by their keys
        theirs, ours = set(groups[0]), set(mine[0])
        if theirs - ours and ours - theirs:
            raise CheckpointError(
                f"{path}: the checkpoint's optimizer has hyperparameters {sorted(theirs - ours)} that this engine's "
                f"{zero.kind} lacks (and lacks its {sorted(ours - theirs)}): another optimizer" + advice
            )
    for i, (hyper, group) in enumerate(zip(groups, mine)):
        for key, value in hyper.items():
            if key in group and not _same_kind(value, group[key]):
                raise CheckpointError(
                    f"{path}: field 'optimizer.param_groups[{i}].{key}' is {value!r}; this optimizer holds "
                    f"{group[key]!r} there"
                )


def _same_kind(saved: Any, current: Any) -> bool:
    """A saved hyperparameter (JSON) can stand where the optimizer holds ``current``: numbers for finite numbers,
    booleans for booleans, sequences of as many for tuples."""
    if current is None:
        return True
    if isinstance(current, bool):
        return isinstance(saved, bool)
    if isinstance(current, (int, float)):
        return isinstance(saved, (int, float)) and not isinstance(saved, bool) and math.isfinite(saved)
    if isinstance(current, (tuple, list)):
        return (
            isinstance(saved, list)
            and len(saved) == len(current)
            and all(_same_kind(s, c) for s, c in zip(saved, current))
        )
    if isinstance(current, str):
        return isinstance(saved, str)
    return True


def _module_tensor(module: torch.nn.Module, name: str) -> Optional[torch.Tensor]:
    owner, _, leaf = name.rpartition(".")
    sub = module.get_submodule(owner) if owner else module
    return getattr(sub, leaf, None)


def _load_flat(zero, index: int, flat, manifest: dict, read: PieceReader, with_optimizer: bool) -> None:
    """Replace one flat group's master shard (and optimizer state) with the saved values; a parameter the
    checkpoint lacks (load_module_strict=False) keeps its current master weights and zero optimizer state."""
    present = sum(read.saved(slot.name) for slot in flat.layout.slots)
    keys = ["master"]
    if with_optimizer:
        group = zero.flat_param_group(index)  # a parameter group's flat groups share one update rule and its keys
        saved_groups = manifest["optimizer"]["flat_groups"]
        saved_keys = {k for g in saved_groups if g["group"] == group for k in g["state_keys"]}
        saved_keys = saved_keys or {k for g in saved_groups for k in g["state_keys"]}
        keys += [f"optim.{k}" for k in sorted(saved_keys)]
    device = zero.state_device
    targets = {key: torch.zeros(flat.layout.shard_numel, dtype=zero.master_dtype, device=device) for key in keys}
    if present < len(flat.layout.slots):
        targets["master"].copy_(zero.read_flat(index)["master"])
    for seg in flat.layout.segments(flat.shard_rank):
        if not read.saved(seg.slot.name):
            continue
        start = seg.flat_start - seg.slot.offset
        for key in keys:
            read(
                seg.slot.name,
                key,
                start,
                start + seg.numel,
                targets[key][seg.shard_start : seg.shard_start + seg.numel],
            )
    scalars = {}
    if with_optimizer:
        group_index = zero.flat_param_group(index)
        for saved in manifest["optimizer"]["flat_groups"]:
            if saved["group"] == group_index:
                scalars = {k: scalar_value(v, device) for k, v in saved["scalars"].items()}
    zero.write_flat(index, {key.removeprefix("optim."): value for key, value in targets.items()}, scalars)


def _load_frozen(flat, manifest: dict, read: PieceReader) -> None:
    """Replace a frozen flat group's shard with the saved values; a parameter the checkpoint lacks (saved with
    exclude_frozen_parameters, or load_module_strict=False) keeps its current values."""
    target = flat.shard_values().clone()
    for seg in flat.layout.segments(flat.shard_rank):
        if read.saved(seg.slot.name):
            start = seg.flat_start - seg.slot.offset
            read(
                seg.slot.name, "master", start, start + seg.numel, target[seg.shard_start : seg.shard_start + seg.numel]
            )
    flat.write_shard(0, target)
    flat.finish_publish()


def _load_training_state(
    state: TrainingState, manifest: dict, sources: Sources, optimizer: bool, scheduler: bool
) -> list[str]:
    """Counters, loss scale, optimizer hyperparameters, sampler, scheduler and RNG; returns what was restored
    and what was reset, for the load report."""
    report = []
    saved, counters = manifest["counters"], state.counters
    counters.global_steps, counters.global_samples = saved["global_steps"], saved["global_samples"]
    counters.skipped_steps = saved["skipped_steps"]
    # resume at an accumulation boundary of *this* run, whose accumulation steps may differ
    counters.micro_steps = counters.global_steps * state.gradient_accumulation_steps
    report.append(f"restored step {counters.global_steps}")
    saved_fp16 = bool(manifest["config"].get("fp16", {}).get("enabled", False))
    zero = state.optimizer
    if zero is not None and manifest["loss_scaler"] is not None:
        scaler = zero.loss_scaler
        if saved_fp16 and state.fp16:
            try:
                scaler.load_state_dict(manifest["loss_scaler"])
            except ValueError as err:
                raise CheckpointError(f"{sources.path}: field 'loss_scaler': {err}") from None
            report.append(f"restored loss scale {scaler.scale:g}")
        elif state.fp16:  # the checkpoint's scale (1.0) means nothing to an fp16 run
            report.append(
                f"reset loss scale to {scaler.scale:g} from the fp16 config (the checkpoint ran without fp16)"
            )
        elif saved_fp16:
            report.append("dropped the checkpoint's fp16 loss scale (this run does not use fp16)")
    if optimizer and zero is not None:
        saved_groups = manifest["optimizer"]["param_groups"]
        if len(saved_groups) != len(zero.param_groups):
            raise CheckpointError(
                f"checkpoint has {len(saved_groups)} optimizer parameter groups, "
                f"the optimizer has {len(zero.param_groups)}"
            )
        for group, hyper in zip(zero.param_groups, saved_groups):
            for key, value in hyper.items():
                group[key] = tuple(value) if isinstance(value, list) and isinstance(group.get(key), tuple) else value
        report.append("restored optimizer state" if any(manifest["optimizer"]["flat_groups"]) else "")
    if state.sampler is not None and manifest.get("sampler"):
        state.sampler.load_state_dict(manifest["sampler"])
    if scheduler and state.lr_scheduler is not None and manifest["lr_scheduler"] is not None:
        state.lr_scheduler.load_state_dict(manifest["lr_scheduler"])
    report.append(_restore_rng(state, manifest, sources))
    return [line for line in report if line]


def _restore_rng(state: TrainingState, manifest: dict, sources: Sources) -> str:
    """This rank's torch and Python RNG states, when the checkpoint ran at this world size (the streams are per
    rank); the line saying so for the load report."""
    rank = comm.get_rank()
    if "imported_from" in manifest:
        return "RNG states not restored (the checkpoint was imported from DeepSpeed, which does not save them)"
    if manifest["world_size"] != state.mesh.world.size:
        return f"RNG states not restored (saved by {manifest['world_size']} ranks)"
    file = rank_file(rank)
    torch.set_rng_state(_rng_state(sources, file, "rng.cpu", torch.get_rng_state()))
    if torch.cuda.is_available() and "rng.cuda" in manifest["files"][file]["crc"]:
        torch.cuda.set_rng_state(_rng_state(sources, file, "rng.cuda", torch.cuda.get_rng_state()))
    python_rng = manifest["python_rng"].get(str(rank))
    try:
        random.setstate((python_rng[0], tuple(python_rng[1]), python_rng[2]))
    except (TypeError, ValueError, IndexError) as err:
        raise CheckpointError(f"{sources.path}: field 'python_rng.{rank}' is not a Python RNG state ({err})") from None
    return "restored RNG states"


def _compression_state(state: TrainingState, manifest: dict, sources: Sources) -> dict[str, torch.Tensor]:
    """This rank's saved 1-bit compression state, when the checkpoint was saved at this layout (the same ranks in the
    same shard groups: each rank's errors are its own); {} otherwise."""
    same = (
        manifest["world_size"],
        manifest["shard_group_size"],
        manifest.get("tensor_parallel_size", 1),
        manifest.get("expert_parallel_size", 1),
    ) == (state.mesh.world.size, state.mesh.shard.size, state.mesh.tensor.size, state.mesh.expert.size)
    if not same or "imported_from" in manifest:
        return {}
    file = rank_file(comm.get_rank())
    out = {}
    for key in manifest["files"].get(file, {}).get("crc", {}):  # a manifest without this rank's file: nothing
        if key.startswith(COMPRESSION):
            entry = sources.reader(file).entry(key)
            dtype = str(DTYPES.get(entry["dtype"])).removeprefix("torch.")
            if dtype not in ("float32", "uint8"):
                raise CheckpointError(f"checkpoint file {sources.reader(file).path}: '{key}' is {dtype}")
            out[key.removeprefix(COMPRESSION)] = sources.read(file, key, dtype).view(entry["shape"])
    return out


def _rng_state(sources: Sources, file: str, key: str, current: torch.Tensor) -> torch.Tensor:
    entry = sources.reader(file).entry(key)
    if entry["dtype"] != "U8" or entry["shape"] != list(current.shape):
        raise CheckpointError(
            f"checkpoint file {sources.reader(file).path}: '{key}' is {entry['dtype']} {entry['shape']}, an RNG "
            f"state is U8 {list(current.shape)}"
        )
    return sources.read(file, key, "uint8")
