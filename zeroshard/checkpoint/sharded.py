"""Saving and loading an engine's full training state as a sharded, atomic, pickle-free checkpoint.

Directory layout of ``save_dir``::

    latest                      the tag of the newest complete checkpoint (replaced atomically, last)
    <tag>/manifest.json         parameters -> pieces, optimizer scalars, counters, scaler, scheduler, config
    <tag>/rankNNNNN.safetensors this rank's shards (fp32 master, optimizer state), RNG state, and on rank 0
                                the tensors outside the flat groups (frozen parameters, buffers)

A save is written into ``.<tag>.tmp``, every file fsynced, then renamed to ``<tag>`` and only then
is ``latest`` updated: a crash at any point leaves ``latest`` naming a complete checkpoint (see
``_commit`` for re-saving an existing tag). Nothing outside the checksummed data is trusted on load: the
manifest carries its own checksum and each file's header checksum, every piece is bounds-checked, and
file names and tags must be plain names inside the checkpoint directory (``manifest.validate``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import shutil
import warnings
from typing import Any, Optional

import torch

from .. import comm
from ..runtime.log import log_rank0
from .client_state import json_ready, read_client_tensors, restore_client_state, split_client_state
from .manifest import FORMAT, Piece, piece_dtype, pieces_for, plain_name, rank_file, seal
from .reading import Sources, assemble, read_manifest, resolve_tag
from .safetensors_io import CheckpointError, write
from .view import TrainingState

_TEXT_BYTES = 4096  # a path or an error message, exchanged between ranks


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write_text(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")


def _scalar(value: Any) -> dict:
    if torch.is_tensor(value):
        return {"value": value.item(), "tensor": True, "dtype": str(value.dtype).removeprefix("torch.")}
    return {"value": value, "tensor": False}


def _unscalar(entry: dict, device) -> Any:
    if entry["tensor"]:
        return torch.tensor(entry["value"], dtype=getattr(torch, entry["dtype"]), device=device)
    return entry["value"]


def _writes_flat(state: TrainingState, flat) -> bool:
    """One copy of each shard: replica 0 of a sharded group, rank 0 of a replicated one."""
    if flat.partitioned:
        return state.grid.replica.rank == 0 if state.grid.replica.size > 1 else True
    return comm.get_rank() == 0


def _writer_files(flat) -> list[str]:
    if not flat.partitioned:
        return [rank_file(0)]
    return [rank_file(r) for r in flat.shard_group.ranks]  # replica 0's shard group is the first row


def _frozen_groups(state: TrainingState) -> list:
    return state.optimizer.frozen_groups if state.optimizer else []


def _outside_tensors(state: TrainingState, exclude_frozen: bool = False) -> dict[str, torch.Tensor]:
    """Frozen parameters (below stage 3) and buffers: not in any flat group, whole on every rank."""
    flats = [*state.optimizer.flat_groups, *state.optimizer.frozen_groups] if state.optimizer else []
    in_flats = {id(p) for f in flats for p in f.params}
    out = {
        f"module.{n}": p
        for n, p in state.module.named_parameters()
        if id(p) not in in_flats and not (exclude_frozen and not p.requires_grad)
    }
    for prefix, sub in state.module.named_modules():
        for name, buffer in sub.named_buffers(recurse=False):
            if buffer is not None and name not in sub._non_persistent_buffers_set:  # as state_dict() decides
                out[f"module.{prefix + '.' if prefix else ''}{name}"] = buffer
    return out


def save(
    state: TrainingState,
    save_dir: str,
    tag: Optional[str] = None,
    client_state: Optional[dict] = None,
    save_latest: bool = True,
    exclude_frozen_parameters: bool = False,
    keep_replaced: bool = False,
) -> str:
    """Every rank calls it. Returns the checkpoint directory. ``exclude_frozen_parameters`` leaves parameters
    without gradients out (a fine-tune's frozen base); loading such a checkpoint keeps the model's own values
    for them and says so. ``keep_replaced``: an existing checkpoint of the same tag is moved aside (to
    ``<tag>.replaced[.N]``, with a warning), not deleted: the engine asks for it when it would replace a step
    checkpoint it did not write itself."""
    tag = tag or f"global_step{state.counters.global_steps}"
    if not isinstance(tag, str) or tag.startswith("."):
        raise ValueError(f"checkpoint tag {tag!r} must be a plain name (no '/' and no leading '.')")
    plain_name(tag, "checkpoint tag", save_dir)
    client, client_tensors = split_client_state(client_state)
    world, rank = state.grid.world, comm.get_rank()
    tag = _ranks_agree(save_dir, tag, world, state.config.checkpoint.tag_validation.lower())
    tmp, final = os.path.join(save_dir, f".{tag}.tmp"), os.path.join(save_dir, tag)
    error = None
    if rank == 0:
        try:
            os.makedirs(save_dir, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        except OSError as err:
            error = err
    _agree_on_write(world, error, save_dir, tmp)

    frozen = [] if exclude_frozen_parameters else _frozen_groups(state)
    outside = _outside_tensors(state, exclude_frozen_parameters)
    try:
        _write_rank_files(state, tmp, frozen, [*outside.items(), *client_tensors.items()] if rank == 0 else [])
    except OSError as err:
        error = err
    _agree_on_write(world, error, save_dir, tmp)

    if rank == 0:
        try:
            manifest = seal(_manifest(state, tag, client, client_tensors, outside, frozen, tmp))
            _atomic_write_text(os.path.join(tmp, "manifest.json"), json.dumps(manifest))
        except OSError as err:
            error = err
    _agree_on_write(world, error, save_dir, tmp)
    if rank == 0:
        _commit(save_dir, tag, save_latest, keep_replaced)
    comm.barrier(world)
    return final


def _write_rank_files(state: TrainingState, tmp: str, frozen: list, others: list) -> None:
    """This rank's tensor file (its shards of every flat group it writes, then ``others`` and its RNG state) and
    the sidecar with the file's checksums, into the temporary checkpoint directory."""
    zero = state.optimizer
    flats = zero.flat_groups if zero else []
    specs: list[tuple[str, torch.dtype, tuple]] = []
    for k, flat in enumerate(flats):
        if _writes_flat(state, flat):
            for key in ["master", *zero.flat_state_keys(k)]:
                name = "master" if key == "master" else f"optim.{key}"
                specs.append((f"{name}.fg{k}", zero.master_dtype, (flat.layout.shard_numel,)))
    for j, flat in enumerate(frozen):
        if _writes_flat(state, flat):  # the compute-precision shard is a frozen parameter's only copy
            specs.append((f"master.ff{j}", flat.dtype, (flat.layout.shard_numel,)))
    others = [*others, ("rng.cpu", torch.get_rng_state())]
    if torch.cuda.is_available():
        others.append(("rng.cuda", torch.cuda.get_rng_state()))
    specs += [(name, t.dtype, tuple(t.shape)) for name, t in others]

    def tensors():  # one flat group's state in memory at a time (it may be read back from NVMe)
        for k, flat in enumerate(flats):
            if _writes_flat(state, flat):
                saved = zero.read_flat(k)
                yield f"master.fg{k}", saved.pop("master")
                yield from ((f"optim.{key}.fg{k}", saved[key]) for key in sorted(saved))
        for j, flat in enumerate(frozen):
            if _writes_flat(state, flat):
                yield f"master.ff{j}", flat.shard_values()
        yield from others

    rank = comm.get_rank()
    path = os.path.join(tmp, rank_file(rank))
    written = write(path, tensors(), specs)
    sidecar = {
        "crc": written.crcs,
        "header_crc": written.header_crc,
        "size": os.path.getsize(path),
        "python_rng": random.getstate(),
    }
    _atomic_write_text(os.path.join(tmp, rank_file(rank, ".json")), json.dumps(sidecar))


def _commit(save_dir: str, tag: str, save_latest: bool, keep_replaced: bool) -> None:
    """Move the complete ``.<tag>.tmp`` into place as ``<tag>`` and point ``latest`` at it.

    Re-saving an existing tag cannot swap two directories atomically, so ``latest`` first moves to the new
    complete copy (``.<tag>.tmp``) when it named the old one; the old directory is moved away, the new one
    renamed, and ``latest`` set to ``<tag>``. A crash between the rename and the last write leaves ``latest``
    naming ``.<tag>.tmp``, which ``resolve_tag`` reads as ``<tag>``. Every step is fsynced, so at every moment
    ``latest`` names a complete checkpoint. With ``keep_replaced`` the old directory is kept under a free name."""
    tmp, final = os.path.join(save_dir, f".{tag}.tmp"), os.path.join(save_dir, tag)
    latest = os.path.join(save_dir, "latest")
    replacing = os.path.exists(final)
    if replacing and _read_latest(save_dir) == tag:
        _atomic_write_text(latest, f".{tag}.tmp")
    trash = os.path.join(save_dir, f".{tag}.old")
    if replacing and keep_replaced:
        aside = _free_name(os.path.join(save_dir, f"{tag}.replaced"))
        warnings.warn(
            f"save_checkpoint: {final} was not written by this run; it is kept as {aside}, not overwritten",
            stacklevel=4,
        )
        os.replace(final, aside)
    elif replacing:
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(final, trash)
    os.replace(tmp, final)
    _fsync_dir(save_dir)
    if save_latest or _read_latest(save_dir) == f".{tag}.tmp":
        _atomic_write_text(latest, tag)
    shutil.rmtree(trash, ignore_errors=True)


def _free_name(path: str) -> str:
    """``path``, or ``path.N`` with the smallest N that names nothing yet."""
    candidate, n = path, 1
    while os.path.lexists(candidate):
        candidate, n = f"{path}.{n}", n + 1
    return candidate


def _ranks_agree(save_dir: str, tag: str, world: comm.Group, tag_validation: str) -> str:
    """Every rank must write into one directory (a path built from each rank's clock or hostname would split
    a checkpoint in pieces): compare the absolute paths before anything is written. Differing tags are
    refused, warned about or ignored as ``checkpoint.tag_validation`` says (DeepSpeed's key; rank 0's tag
    names the checkpoint)."""
    pairs = [text.split("\n", 1) for text in gather_text(f"{os.path.abspath(save_dir)}\n{tag}", world)]
    paths, tags = [p[0] for p in pairs], [p[-1] for p in pairs]
    if len(set(tags)) > 1 and tag_validation != "ignore":
        listing = ", ".join(f"rank {r}: {t!r}" for r, t in enumerate(tags))
        message = f"save_checkpoint: the ranks pass different tags ({listing})"
        if tag_validation == "fail":
            raise ValueError(message + '; pass one tag on every rank (checkpoint.tag_validation is "Fail")')
        warnings.warn(message + f"; the checkpoint is saved as rank 0's tag {tags[0]!r}", stacklevel=4)
    if len(set(paths)) > 1:
        listing = ", ".join(f"rank {r}: {p}" for r, p in enumerate(paths))
        raise ValueError(
            f"save_checkpoint: the ranks name different save directories ({listing}); every rank must pass the "
            "same save_dir (build it once, e.g. on rank 0, and share it)"
        )
    return tags[0]


def gather_text(text: str, world: comm.Group) -> list[str]:
    """Every rank's ``text`` (cut at ``_TEXT_BYTES`` bytes), in rank order: one small all-gather."""
    if world.size == 1:
        return [text]
    mine = text.encode()[:_TEXT_BYTES]
    local = torch.zeros(_TEXT_BYTES, dtype=torch.uint8)
    local[: len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8) if mine else local[:0]
    every = torch.empty(world.size * _TEXT_BYTES, dtype=torch.uint8)
    comm.all_gather(every, local, world)
    rows = every.view(world.size, _TEXT_BYTES)
    return [bytes(row.tolist()).rstrip(b"\x00").decode(errors="replace") for row in rows]


def _failed_ranks(error: Optional[Exception], world: comm.Group) -> list[int]:
    """The ranks whose ``error`` is set (one small all-reduce, so every rank knows them all)."""
    failed = torch.zeros(world.size)
    failed[comm.get_rank()] = 1.0 if error is not None else 0.0
    comm.all_reduce(failed, world)
    return [r for r in range(world.size) if failed[r] > 0]


def _agree_on_write(world: comm.Group, error: Optional[OSError], save_dir: str, tmp: str) -> None:
    """After each writing phase: if any rank failed (disk full, permissions), every rank raises, the partial
    ``.tmp`` directory is removed, and the checkpoint that ``latest`` names is untouched."""
    ranks = _failed_ranks(error, world)
    if not ranks:
        return
    if comm.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    kept = _read_latest(save_dir)
    kept_text = f"the previous checkpoint '{kept}' is kept" if kept else "no earlier checkpoint was there"
    cause = f"{error.strerror or error} ({error.filename or tmp})" if error is not None else "see those ranks' errors"
    raise CheckpointError(
        f"saving a checkpoint into {save_dir} failed on rank(s) {ranks}: {cause}; the partial save was removed "
        f"and {kept_text}"
    )


def _read_latest(save_dir: str) -> Optional[str]:
    try:
        with open(os.path.join(save_dir, "latest")) as f:
            return f.read().strip()
    except OSError:
        return None


def _aliases(module: torch.nn.Module) -> dict[str, str]:
    """Second names of shared parameters (a tied LM head) -> the name they are saved under."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def _collect_sidecars(tmp: str, world_size: int) -> tuple[dict, dict]:
    """Each rank's file checksums and Python RNG state (written beside its file), folded into the manifest."""
    files, rng = {}, {}
    for r in range(world_size):
        path = os.path.join(tmp, rank_file(r, ".json"))
        with open(path) as f:
            side = json.load(f)
        os.remove(path)
        files[rank_file(r)] = {"size": side["size"], "header_crc": side["header_crc"], "crc": side["crc"]}
        rng[str(r)] = side["python_rng"]
    return files, rng


def _sharded_entries(zero, frozen: list) -> tuple[dict[str, dict], list[dict]]:
    """Where each parameter's pieces are (world-size independent: FQN, shape, pieces) and each flat group's
    optimizer state keys and scalars. Frozen flat groups (stage 3) are saved like master shards, as ``ff<j>``."""
    params: dict[str, dict] = {}
    flat_groups = []
    keyed = [(f"fg{k}", flat) for k, flat in enumerate(zero.flat_groups if zero else [])]
    for key, flat in keyed + [(f"ff{j}", flat) for j, flat in enumerate(frozen)]:
        for name, plist in pieces_for(flat.layout, key, _writer_files(flat)).items():
            params.setdefault(name, {"pieces": []})["pieces"] += [p.to_json() for p in plist]
        for slot, param in zip(flat.layout.slots, flat.params):
            params[slot.name].update(shape=list(slot.shape), dtype=str(param.dtype).removeprefix("torch."))
    for k in range(len(zero.flat_groups) if zero else 0):
        flat_groups.append(
            {
                "group": zero.flat_param_group(k),
                "state_keys": zero.flat_state_keys(k),
                "scalars": {key: _scalar(v) for key, v in zero.flat_scalars(k).items()},
            }
        )
    return params, flat_groups


def _rank0_entries(tensors: dict[str, torch.Tensor]) -> dict[str, dict]:
    """Tensors stored whole in rank 0's file, in their own dtype."""
    return {
        name: {"file": rank_file(0), "key": name, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
        for name, t in tensors.items()
    }


def _manifest(
    state: TrainingState,
    tag: str,
    client: dict,
    client_tensors: dict[str, torch.Tensor],
    outside: dict[str, torch.Tensor],
    frozen: list,
    tmp: str,
) -> dict:
    zero = state.optimizer
    files, rng = _collect_sidecars(tmp, state.grid.world.size)
    params, flat_groups = _sharded_entries(zero, frozen)
    module_tensors = {name.removeprefix("module."): entry for name, entry in _rank0_entries(outside).items()}
    scheduler = state.lr_scheduler.state_dict() if state.lr_scheduler is not None else None
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in zero.param_groups] if zero else []
    return {
        "format": FORMAT,
        "tag": tag,
        "world_size": state.grid.world.size,
        "stage": state.config.zero_optimization.stage,
        "shard_group_size": state.grid.shard.size,
        "counters": dataclasses.asdict(state.counters),
        "loss_scaler": zero.loss_scaler.state_dict() if zero else None,
        "lr_scheduler": json_ready(scheduler, "the lr scheduler's state_dict()"),
        "optimizer": {
            "param_groups": json_ready(hyper, "optimizer hyperparameters"),
            "flat_groups": flat_groups,
            **({"type": zero.kind} if zero else {}),
        },
        "params": params,
        "module_tensors": module_tensors,
        "excluded_frozen": [n.removeprefix("module.") for n in _outside_tensors(state) if n not in outside]
        + [slot.name for flat in _frozen_groups(state) if flat not in frozen for slot in flat.layout.slots],
        "files": files,
        "python_rng": rng,
        "aliases": {a: t for a, t in _aliases(state.module).items() if t in params or t in module_tensors},
        "config": state.config.model_dump(mode="json"),
        "client_state": client,
        "client_tensors": _rank0_entries(client_tensors),
        "sampler": state.sampler.state_dict() if state.sampler is not None else None,
    }


def _check_params(state: TrainingState, manifest: dict, strict: bool) -> tuple[list[str], list[str]]:
    """Shapes must match; with ``strict`` the names too. Returns (missing from the checkpoint, not in the model)."""
    mine = {n: tuple(p.shape) for n, p in state.module.named_parameters()}  # tied aliases appear once
    saved = {n: tuple(e["shape"]) for n, e in manifest["params"].items()}
    saved.update({n: tuple(e["shape"]) for n, e in manifest["module_tensors"].items()})
    mine.update({n.removeprefix("module."): tuple(t.shape) for n, t in _outside_tensors(state).items()})
    wrong = [f"{n}: checkpoint {saved[n]} vs model {s}" for n, s in mine.items() if n in saved and saved[n] != s]
    missing = sorted(set(mine) - set(saved) - set(manifest.get("excluded_frozen", [])))
    unexpected = sorted(set(saved) - set(mine))
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


def load(
    state: TrainingState,
    load_dir: str,
    tag: Optional[str] = None,
    load_module_strict: bool = True,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
):
    """Every rank calls it. Returns ``(path, client_state)``, or ``(None, None)`` when there is nothing to load."""
    tag = resolve_tag(load_dir, tag)
    if tag is None:
        warnings.warn(f"no checkpoint to load in {load_dir} (no 'latest' file); starting from scratch", stacklevel=3)
        return None, None
    path = os.path.join(load_dir, tag)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    manifest = read_manifest(path)
    missing, unexpected = _check_params(state, manifest, load_module_strict)
    if state.optimizer is not None and load_optimizer_states and not load_module_only:
        _check_optimizer(state.optimizer, manifest, path)
    sources = Sources(path, manifest)
    zero = state.optimizer
    error: Optional[CheckpointError] = None
    report: list[str] = []
    client_state = None
    try:  # reading and verifying issues no collective, so a rank that fails cannot strand the others
        with torch.no_grad():
            for k, flat in enumerate(zero.flat_groups if zero else []):
                _load_flat(zero, k, flat, manifest, sources, load_optimizer_states and not load_module_only)
            for flat in _frozen_groups(state):
                _load_frozen(flat, manifest, sources)
            for name, entry in manifest["module_tensors"].items():
                target = _module_tensor(state.module, name) if name not in unexpected else None
                if target is not None:
                    target.copy_(sources.read_whole(name, entry))
            client_state = restore_client_state(manifest["client_state"], read_client_tensors(sources, manifest))
            if not load_module_only:
                report = _load_training_state(state, manifest, sources, load_optimizer_states, load_lr_scheduler_states)
    except CheckpointError as err:
        error = err
    finally:
        sources.close()
    _agree(state.grid.world, error, path)
    if missing or unexpected:
        report.append(
            f"load_module_strict=False: kept as initialized (not in the checkpoint) {missing}; "
            f"ignored (not in the model) {unexpected}"
        )
    log_rank0(f"load_checkpoint {path}: " + "; ".join(report or ["module weights restored"]))
    if zero is not None:
        with torch.no_grad():
            zero.publish()  # the compute parameters follow the loaded master weights
    return path, (None if load_module_only else client_state)


def _agree(world: comm.Group, error: Optional[CheckpointError], path: str) -> None:
    """Every rank raises if any rank failed to read its part: the failing ranks with their own message, the
    others with the first failing rank's (so every rank's log names the file and field)."""
    ranks = _failed_ranks(error, world)
    if not ranks:
        return
    messages = gather_text(str(error) if error is not None else "", world)
    if error is not None:
        raise error
    raise CheckpointError(f"loading {path} failed on rank(s) {ranks}: rank {ranks[0]}: {messages[ranks[0]]}")


def _module_tensor(module: torch.nn.Module, name: str) -> Optional[torch.Tensor]:
    owner, _, leaf = name.rpartition(".")
    sub = module.get_submodule(owner) if owner else module
    return getattr(sub, leaf, None)


def _load_flat(zero, index: int, flat, manifest: dict, sources: Sources, with_optimizer: bool) -> None:
    """Replace one flat group's master shard (and optimizer state) with the saved values; a parameter the
    checkpoint lacks (load_module_strict=False) keeps its current master weights and zero optimizer state."""
    saved = manifest["params"]
    pieces = {
        slot.name: [Piece.from_json(p) for p in saved[slot.name]["pieces"]]
        for slot in flat.layout.slots
        if slot.name in saved
    }
    keys = ["master"]
    if with_optimizer:
        saved_keys = {k for g in manifest["optimizer"]["flat_groups"] for k in g["state_keys"]}
        keys += [f"optim.{k}" for k in sorted(saved_keys)]
    device = zero.state_device
    targets = {key: torch.zeros(flat.layout.shard_numel, dtype=zero.master_dtype, device=device) for key in keys}
    if len(pieces) < len(flat.layout.slots):
        targets["master"].copy_(zero.read_flat(index)["master"])
    for seg in flat.layout.segments(flat.shard_rank):
        if seg.slot.name not in pieces:
            continue
        start = seg.flat_start - seg.slot.offset
        for key in keys:
            assemble(
                sources,
                pieces[seg.slot.name],
                key,
                piece_dtype(manifest, seg.slot.name, pieces[seg.slot.name][0].key),
                start,
                start + seg.numel,
                targets[key][seg.shard_start : seg.shard_start + seg.numel],
            )
    scalars = {}
    if with_optimizer:
        group_index = zero.flat_param_group(index)
        for saved in manifest["optimizer"]["flat_groups"]:
            if saved["group"] == group_index:
                scalars = {k: _unscalar(v, device) for k, v in saved["scalars"].items()}
    zero.write_flat(index, {key.removeprefix("optim."): value for key, value in targets.items()}, scalars)


def _load_frozen(flat, manifest: dict, sources: Sources) -> None:
    """Replace a frozen flat group's shard with the saved values; a parameter the checkpoint lacks (saved with
    exclude_frozen_parameters, or load_module_strict=False) keeps its current values."""
    saved = manifest["params"]
    target = flat.shard_values().clone()
    for seg in flat.layout.segments(flat.shard_rank):
        if seg.slot.name in saved:
            pieces = [Piece.from_json(p) for p in saved[seg.slot.name]["pieces"]]
            start = seg.flat_start - seg.slot.offset
            out = target[seg.shard_start : seg.shard_start + seg.numel]
            dtype = piece_dtype(manifest, seg.slot.name, "ff")
            assemble(sources, pieces, "master", dtype, start, start + seg.numel, out)
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
    rank = comm.get_rank()
    if manifest["world_size"] == state.grid.world.size:  # RNG streams are per rank: restore only same-size runs
        file = rank_file(rank)
        torch.set_rng_state(_rng_state(sources, file, "rng.cpu", torch.get_rng_state()))
        if torch.cuda.is_available() and "rng.cuda" in manifest["files"][file]["crc"]:
            torch.cuda.set_rng_state(_rng_state(sources, file, "rng.cuda", torch.cuda.get_rng_state()))
        python_rng = manifest["python_rng"].get(str(rank))
        try:
            random.setstate((python_rng[0], tuple(python_rng[1]), python_rng[2]))
        except (TypeError, ValueError, IndexError) as err:
            raise CheckpointError(
                f"{sources.path}: field 'python_rng.{rank}' is not a Python RNG state ({err})"
            ) from None
        report.append("restored RNG states")
    else:
        report.append(f"RNG states not restored (saved by {manifest['world_size']} ranks)")
    return [line for line in report if line]


def _rng_state(sources: Sources, file: str, key: str, current: torch.Tensor) -> torch.Tensor:
    entry = sources.reader(file).entry(key)
    if entry["dtype"] != "U8" or entry["shape"] != list(current.shape):
        raise CheckpointError(
            f"checkpoint file {sources.reader(file).path}: '{key}' is {entry['dtype']} {entry['shape']}, an RNG "
            f"state is U8 {list(current.shape)}"
        )
    return sources.read(file, key, "uint8")
