"""Saving an engine's full training state as a sharded, atomic, pickle-free checkpoint.

Directory layout of ``save_dir``::

    latest                      the tag of the newest complete checkpoint (replaced atomically, last)
    <tag>/manifest.json         parameters -> pieces, optimizer scalars, counters, scaler, scheduler, config
    <tag>/rankNNNNN.safetensors this rank's shards (fp32 master, optimizer state), RNG state, and on rank 0
                                the tensors outside the flat groups (frozen parameters, buffers)

A save is written into ``.<tag>.tmp``, every file fsynced, then committed (``commit.py``). Nothing outside the
checksummed data is trusted on load (``load.py``): the manifest carries its own checksum and each file's header
checksum, every piece is bounds-checked, and file names and tags must be plain names inside the checkpoint
directory (``manifest.validate``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
from typing import Any, Optional

import torch

from .. import comm
from .agreement import agree_on_write, ranks_agree
from .client_state import json_ready, split_client_state
from .commit import atomic_write_text, commit
from .manifest import FORMAT, pieces_for, plain_name, rank_file, seal
from .reading import load_json
from .safetensors_io import write
from .view import TrainingState

COMPRESSION = "compression."  # a rank file's 1-bit compression state, restored at the same layout only


def _scalar(value: Any) -> dict:
    if torch.is_tensor(value):
        return {"value": value.item(), "tensor": True, "dtype": str(value.dtype).removeprefix("torch.")}
    return {"value": value, "tensor": False}


def _writes_flat(state: TrainingState, flat) -> bool:
    """One copy of each shard: replica 0 of a sharded group, the first rank of the group holding a replicated one
    (the data-parallel ranks; for experts, the ranks holding the same experts); of a flat group replicated over the
    tensor-parallel group, tensor-parallel rank 0's only (experts are not when their group spans tensor ranks); of a
    tied module pipeline stages share, the first stage's only."""
    if state.mirrors(flat.layout.slots[0].name):
        return False
    if state.mesh.tensor.rank > 0 and not state.mesh.dims.splits_over_tensor(flat.layout.split_axis):
        return False
    if flat.partitioned:
        return state.mesh.replica.rank == 0 if state.mesh.replica.size > 1 else True
    return flat.shard_group.rank == 0


def _writer_files(flat, dims: comm.ParallelDims, piece: int = 0) -> list[str]:
    """The files holding the shards of ``flat`` as the rank holding piece ``piece`` of its split axis laid it out
    (rank 0 writes the manifest from its own layouts: the mesh says which ranks hold the same shards of the other
    pieces)."""
    writers = flat.shard_group.ranks if flat.partitioned else (comm.get_rank(),)  # replica 0's group: rank 0's
    axis = flat.layout.split_axis
    return [rank_file(dims.rank_at(r, **{axis: piece}) if axis else r) for r in writers]


def outside_tensors(state: TrainingState, exclude_frozen: bool = False) -> dict[str, torch.Tensor]:
    """Frozen parameters (below stage 3) and buffers: not in any flat group, whole on every rank."""
    in_flats = {id(p) for f in [*state.flat_groups, *state.frozen_groups] for p in f.params}
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
    world, rank = state.mesh.world, comm.get_rank()
    tag = ranks_agree(save_dir, tag, world, state.config.checkpoint.tag_validation.lower())
    tmp, final = os.path.join(save_dir, f".{tag}.tmp"), os.path.join(save_dir, tag)
    error = None
    if rank == 0:
        try:
            os.makedirs(save_dir, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        except OSError as err:
            error = err
    agree_on_write(world, error, save_dir, tmp)

    frozen = [] if exclude_frozen_parameters else state.frozen_groups
    outside = {n: t for n, t in outside_tensors(state, exclude_frozen_parameters).items() if not state.mirrors(n)}
    pieces_outside = sorted(set(state.tensor_splits) & {name.removeprefix("module.") for name in outside})
    if pieces_outside:  # every rank has the same model: all refuse, before anything is written
        raise NotImplementedError(
            f"save_checkpoint at ZeRO stage {state.config.zero_optimization.stage}: frozen tensor- or expert-parallel "
            f"parameters outside ZeRO's flat groups ({pieces_outside[:4]}) are not saved yet; use ZeRO stage 3 (it "
            "shards frozen pieces with their gather units) or exclude_frozen_parameters=True"
        )
    try:
        _write_own_files(state, tmp, frozen, outside, client_tensors, exclude_frozen_parameters)
    except OSError as err:
        error = err
    agree_on_write(world, error, save_dir, tmp)

    if rank == 0:
        try:
            manifest = seal(_manifest(state, tag, client, client_tensors, tmp))
            atomic_write_text(os.path.join(tmp, "manifest.json"), json.dumps(manifest))
        except OSError as err:
            error = err
    agree_on_write(world, error, save_dir, tmp)
    if rank == 0:
        commit(save_dir, tag, save_latest, keep_replaced)
        universal = os.path.join(save_dir, "latest_universal")
        if save_latest and (state.config.checkpoint.load_universal or os.path.lexists(universal)):
            # a zeroshard checkpoint resumes at any world size, stage and layout: it is what DeepSpeed's
            # load_universal asks 'latest_universal' to name (ms-swift's elastic restarts look for the file); once
            # the file exists it follows every save, so a resume with load_universal never takes an older step
            atomic_write_text(universal, tag)
    comm.barrier(world)
    return final


def _write_own_files(state: TrainingState, tmp: str, frozen: list, outside: dict, client_tensors: dict, exclude: bool):
    """This rank's files: its tensor file (the tensors outside the flat groups on the first rank of each pipeline stage,
    the client's on rank 0) and, from a stage's first rank, what its stage holds (rank 0's manifest merges them)."""
    first = state.mesh.stage.rank == 0
    whole = [*(outside.items() if first else ()), *(client_tensors.items() if comm.get_rank() == 0 else ())]
    _write_rank_files(state, tmp, frozen, whole)
    if first:
        entries = _stage_entries(state, frozen, outside, exclude)
        atomic_write_text(os.path.join(tmp, _stage_file(state.mesh.pipe.rank)), json.dumps(entries))


def _write_rank_files(state: TrainingState, tmp: str, frozen: list, others: list) -> None:
    """This rank's tensor file (its shards of every flat group it writes, then ``others`` and its RNG state) and
    the sidecar with the file's checksums, into the temporary checkpoint directory."""
    zero, flats = state.optimizer, state.flat_groups
    specs: list[tuple[str, torch.dtype, tuple]] = []
    for k, flat in enumerate(flats):
        if _writes_flat(state, flat):
            for key in ["master", *zero.flat_state_keys(k)]:
                name = "master" if key == "master" else f"optim.{key}"
                specs.append((f"{name}.fg{k}", zero.master_dtype, (flat.layout.shard_numel,)))
    for j, flat in enumerate(frozen):
        if _writes_flat(state, flat):  # the compute-precision shard is a frozen parameter's only copy
            specs.append((f"master.ff{j}", flat.dtype, (flat.layout.shard_numel,)))
    compression = zero.compression_state() if zero is not None else {}  # this rank's own: 1-bit Adam's errors
    others = [*others, *((f"{COMPRESSION}{n}", t) for n, t in compression.items()), ("rng.cpu", torch.get_rng_state())]
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
                yield f"master.ff{j}", zero.read_frozen(j)
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
    atomic_write_text(os.path.join(tmp, rank_file(rank, ".json")), json.dumps(sidecar))


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
        side = load_json(path)
        os.remove(path)
        files[rank_file(r)] = {"size": side["size"], "header_crc": side["header_crc"], "crc": side["crc"]}
        rng[str(r)] = side["python_rng"]
    return files, rng


def _sharded_entries(state: TrainingState, flats: list, frozen: list) -> tuple[dict[str, dict], list[dict]]:
    """Where each parameter's pieces are (world-size independent: FQN, shape, pieces) and each flat group's
    optimizer state keys and scalars. Frozen flat groups (stage 3) are saved like master shards, as ``ff<j>``. A
    tensor-parallel parameter (or a tensor of experts) is described whole: its ``split``, and pieces covering every
    tensor-parallel (expert-parallel) rank's piece in rank order."""
    zero, dims, experts = state.optimizer, state.mesh.dims, state.expert_names
    params: dict[str, dict] = {}
    flat_groups = []
    keyed = [(f"fg{k}", flat) for k, flat in enumerate(flats)]
    for key, flat in keyed + [(f"ff{j}", flat) for j, flat in enumerate(frozen)]:
        if state.mirrors(flat.layout.slots[0].name):
            continue  # an earlier pipeline stage saves this tied module
        numels = {slot.name: slot.numel for slot in flat.layout.slots}
        axis = flat.layout.split_axis
        for piece in range(getattr(dims, axis) if axis else 1):
            for name, plist in pieces_for(flat.layout, key, _writer_files(flat, dims, piece)).items():
                if name in experts:  # one expert of a layer, whole, under its global index on that expert rank
                    params[experts[name][piece]] = {"pieces": [p.to_json() for p in plist]}
                    continue
                shift = piece * numels[name]
                shifted = [dataclasses.replace(p, param_offset=p.param_offset + shift) for p in plist]
                params.setdefault(name, {"pieces": []})["pieces"] += [p.to_json() for p in shifted]
        for slot, param in zip(flat.layout.slots, flat.params):
            if slot.name in experts:
                for name in experts[slot.name]:
                    params[name].update(shape=list(slot.shape), dtype=str(param.dtype).removeprefix("torch."))
                continue
            split = slot.split
            shape = split.full_shape(tuple(slot.shape)) if split is not None else tuple(slot.shape)
            params[slot.name].update(shape=list(shape), dtype=str(param.dtype).removeprefix("torch."))
            if split is not None:
                params[slot.name]["split"] = split.as_record()
    for k in range(len(flats)):
        flat_groups.append(
            {
                "group": zero.flat_param_group(k),
                "state_keys": zero.flat_state_keys(k),
                "scalars": {key: _scalar(v) for key, v in zero.flat_scalars(k).items()},
            }
        )
    return params, flat_groups


def _file_entries(tensors: dict[str, torch.Tensor], file: str) -> dict[str, dict]:
    """Tensors stored whole in ``file``, in their own dtype."""
    return {
        name: {"file": file, "key": name, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
        for name, t in tensors.items()
    }


def _stage_file(stage: int) -> str:
    return f"stage{stage:05d}.json"


def _stage_entries(state: TrainingState, frozen: list, outside: dict[str, torch.Tensor], exclude_frozen: bool) -> dict:
    """What one pipeline stage (the whole model without one) holds, written by its first rank: where each parameter's
    pieces are, each flat group's optimizer keys and scalars, the tensors saved whole in that rank's file."""
    params, flat_groups = _sharded_entries(state, state.flat_groups, frozen)
    whole = _file_entries(outside, rank_file(comm.get_rank()))
    module_tensors = {name.removeprefix("module."): entry for name, entry in whole.items()}
    excluded = [n.removeprefix("module.") for n in outside_tensors(state) if exclude_frozen and n not in outside]
    excluded += [slot.name for flat in state.frozen_groups if flat not in frozen for slot in flat.layout.slots]
    held = set(params) | set(module_tensors)
    aliases = {a: t for a, t in _aliases(state.module).items() if t in held or state.mirrors(t)}
    return {
        "params": params,
        "flat_groups": flat_groups,
        "module_tensors": module_tensors,
        "aliases": aliases,
        "excluded_frozen": [n for n in excluded if not state.mirrors(n)],
    }


def _merged_stages(tmp: str, stages: int) -> dict:
    """The stages' entries as one model's (parameter names differ between stages; a tied module is its first
    stage's)."""
    merged: dict = {"params": {}, "flat_groups": [], "module_tensors": {}, "aliases": {}, "excluded_frozen": []}
    for stage in range(stages):
        path = os.path.join(tmp, _stage_file(stage))
        entries = load_json(path)
        os.remove(path)
        for key, value in entries.items():
            if isinstance(value, list):
                merged[key] += value
            else:
                merged[key].update(value)
    return merged


def _manifest(state: TrainingState, tag: str, client: dict, client_tensors: dict[str, torch.Tensor], tmp: str) -> dict:
    zero = state.optimizer
    files, rng = _collect_sidecars(tmp, state.mesh.world.size)
    stages = _merged_stages(tmp, state.pipeline.stages if state.pipeline is not None else 1)
    params, flat_groups, module_tensors = stages["params"], stages["flat_groups"], stages["module_tensors"]
    scheduler = state.lr_scheduler.state_dict() if state.lr_scheduler is not None else None
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in zero.param_groups] if zero else []
    return {
        "format": FORMAT,
        "tag": tag,
        "world_size": state.mesh.world.size,
        "tensor_parallel_size": state.mesh.tensor.size,
        "expert_parallel_size": state.mesh.expert.size,
        "sequence_parallel_size": state.mesh.sequence.size,
        "expert_tensor_ranks": state.mesh.dims.ep_in_tp,
        "stage": state.config.zero_optimization.stage,
        "shard_group_size": state.mesh.shard.size,
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
        "excluded_frozen": stages["excluded_frozen"],
        "files": files,
        "python_rng": rng,
        "aliases": stages["aliases"],
        "pipeline": state.pipeline.record() if state.pipeline is not None else None,
        "config": state.config.model_dump(mode="json"),
        "client_state": client,
        "client_tensors": _file_entries(client_tensors, rank_file(0)),
        "sampler": state.sampler.state_dict() if state.sampler is not None else None,
    }
