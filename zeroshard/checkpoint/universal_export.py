"""Writing a DeepSpeed universal checkpoint (the folder DeepSpeed resumes with ``"checkpoint": {"load_universal":
true}``) from a zeroshard checkpoint or DeepSpeed's ZeRO rank files: ``zeroshard convert CK OUT --to
deepspeed-universal`` and ``python -m deepspeed.checkpoint.ds_to_universal`` in compat mode. The layout is the one
:mod:`.deepspeed_universal` reads.

DeepSpeed's own loader takes whatever ``<key>.pt`` files a parameter folder holds, so a folder written here carries
each optimizer's own state keys (not Adam's only); what the universal format has no place for (the update rule,
scalar state besides the step, zeroshard's hyperparameters as they were) rides in ``optimizer_state.pt`` under
``zeroshard`` (DeepSpeed ignores the key), so zeroshard -> universal -> zeroshard is exact for every optimizer.
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Any, Optional

import torch

from .client_state import read_client_tensors, restore_client_state
from .commit import atomic_write_text
from .deepspeed_import import is_deepspeed_checkpoint, read_deepspeed_checkpoint
from .deepspeed_record import ENGINE_KEYS
from .deepspeed_universal import LATEST_UNIVERSAL, MODEL_STATES, OWN_RECORD, in_memory, is_universal_checkpoint
from .manifest import plain_name
from .reading import Sources, read_manifest, read_parameter, resolve_tag, scalar_value
from .safetensors_io import CheckpointError

DEEPSPEED_LAYOUT = "0.19.8"  # the DeepSpeed whose universal layout is written (its loader checks the version)


def export_universal_checkpoint(
    ckpt_dir: str, out_dir: str, tag: Optional[str] = None, pipeline_stages: Optional[int] = None
) -> str:
    """``zeroshard convert CK OUT --to deepspeed-universal``: the zeroshard checkpoint ``ckpt_dir`` (tag ``tag``
    or its ``latest``; weights joined whole whatever the tensor- or expert-parallel degree) as a universal folder
    ``OUT/<tag>_universal`` with ``OUT/latest_universal``, which DeepSpeed resumes with ``"checkpoint":
    {"load_universal": true}`` at any world size and ZeRO stage. ``pipeline_stages``: a pipeline's checkpoint, for
    DeepSpeed's pipeline engine at that many stages (see :func:`write_universal_folder`). Returns its path."""
    tag = resolve_tag(ckpt_dir, tag)
    if tag is None:
        raise CheckpointError(f"{ckpt_dir}: no 'latest' file; pass the checkpoint's tag with --tag")
    output = os.path.join(out_dir, f"{tag}_universal")
    return write_universal_folder(os.path.join(ckpt_dir, tag), output, pipeline_stages)


def write_universal_folder(input_folder: str, output_folder: str, pipeline_stages: Optional[int] = None) -> str:
    """DeepSpeed's ``ds_to_universal`` contract: the checkpoint in the tag folder ``input_folder`` (zeroshard's, or
    DeepSpeed's ZeRO rank files) written as the universal folder ``output_folder``, with ``latest_universal`` beside
    it naming it. Written into a hidden folder and renamed; an existing folder is never replaced.

    ``pipeline_stages``: a pipeline's checkpoint for DeepSpeed's pipeline engine at that many stages: its weights also
    as DeepSpeed's layer files (``layer_XX-model_states.pt``, each layer's tensors under its own names, a tied module
    at its first index), and one engine state per stage (``mp_rank_XX_model_states.pt``, ``module: None``), which
    DeepSpeed 0.19.8's pipeline engine resumes with ``load_universal`` (tested against it at PP2 x DP2 and PP4)."""
    if pipeline_stages is not None and (
        isinstance(pipeline_stages, bool) or not isinstance(pipeline_stages, int) or not 1 <= pipeline_stages <= 4096
    ):
        raise CheckpointError(f"pipeline_stages must be an int in 1..4096, got {pipeline_stages!r}")
    input_folder, output_folder = os.path.normpath(input_folder), os.path.normpath(output_folder)
    out_dir, out_tag = os.path.split(output_folder)
    plain_name(out_tag, "output folder name", out_dir or ".")
    if os.path.exists(output_folder):
        raise CheckpointError(f"{output_folder} exists; export into another directory (nothing was replaced)")
    if is_universal_checkpoint(input_folder):
        raise CheckpointError(
            f'{input_folder} is already a universal checkpoint: resume it with "checkpoint": '
            '{"load_universal": true}, or import it with `zeroshard convert --from-deepspeed DIR OUT --tag TAG`; '
            "nothing written"
        )
    if os.path.isfile(os.path.join(input_folder, "manifest.json")):
        manifest = read_manifest(input_folder)
        sources: Any = Sources(input_folder, manifest)
    elif is_deepspeed_checkpoint(input_folder):
        parent, tag = os.path.split(input_folder)
        manifest, sources = in_memory(read_deepspeed_checkpoint(parent, tag), tag)
    else:
        raise CheckpointError(
            f"{input_folder}: neither a zeroshard checkpoint (manifest.json) nor DeepSpeed's ZeRO rank files"
        )
    tmp = os.path.join(out_dir, f".{out_tag}.tmp")
    try:
        try:
            pipeline = None  # (stages, the layers with files), checked before anything is written
            if pipeline_stages is not None:
                pipeline = (pipeline_stages, _pipeline_files(manifest, pipeline_stages))
            os.makedirs(out_dir or ".", exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(os.path.join(tmp, "zero"))
            _write_universal(sources, manifest, tmp, pipeline)
            os.rename(tmp, output_folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            sources.close()
        atomic_write_text(os.path.join(out_dir, LATEST_UNIVERSAL), out_tag)
    except OSError as err:
        raise CheckpointError(
            f"cannot write the universal folder {output_folder}: {err.strerror or err} ({err.filename or out_dir}); "
            "choose a writable output folder (nothing was replaced)"
        ) from err
    return output_folder


def _write_optimizer_state(manifest: dict, groups: list[dict], path: str) -> None:
    """``zero/optimizer_state.pt``: DeepSpeed's per-group hyperparameters and steps, and zeroshard's own record of
    what the universal format has no place for (the update rule, every scalar, the state keys)."""
    optimizer = manifest["optimizer"]
    flat_groups = optimizer["flat_groups"]
    scalars = [{} for _ in groups]
    state_keys: list[set] = [set() for _ in groups]  # the reader refuses a folder missing any of them
    for flat in flat_groups:
        scalars[flat["group"]].update(flat["scalars"])
        state_keys[flat["group"]].update(flat["state_keys"])
    hyper = optimizer["param_groups"]
    stage3_state = {g: {"step": scalar_value(s["step"])} for g, s in enumerate(scalars) if "step" in s}
    torch.save(
        {
            "zero_stage": int(manifest["stage"]) or 1,
            "ds_version": DEEPSPEED_LAYOUT,
            "dynamic_loss_scale": False,
            "overflow": False,
            "param_groups": [{**_deepspeed_hyper(h), "params": list(range(len(g)))} for h, g in zip(hyper, groups)],
            "optimizer_state_dict": {"state": stage3_state, "param_groups": [_deepspeed_hyper(h) for h in hyper]},
            OWN_RECORD: {
                "type": optimizer.get("type"),
                "param_groups": hyper,
                "scalars": scalars,
                "state_keys": [sorted(keys) for keys in state_keys],
            },
        },
        path,
    )


def _write_universal(sources: Sources, manifest: dict, tmp: str, pipeline: Optional[tuple[int, list]] = None) -> None:
    optimizer = manifest["optimizer"]
    flat_groups = optimizer["flat_groups"]
    groups: list[dict[str, list[int]]] = [{} for _ in optimizer["param_groups"]] or [{}]
    module: dict[str, torch.Tensor] = {}
    frozen: dict[str, list[int]] = {}
    for name, entry in manifest["params"].items():
        master = read_parameter(sources, name, "master")
        module[name] = master.to(getattr(torch, entry.get("dtype", "float32")))
        index = _flat_index(entry)
        folder = os.path.join(tmp, "zero", plain_name(name, "parameter name", tmp))
        os.makedirs(folder)
        torch.save({"param": master.float(), "cat_dim": 0}, os.path.join(folder, "fp32.pt"))
        if index is None or index >= len(flat_groups):
            frozen[name] = list(entry["shape"])  # its weights only, as DeepSpeed writes parameters without state
            continue
        flat = flat_groups[index]
        groups[flat["group"]][name] = list(entry["shape"])
        for key in flat["state_keys"]:
            state = read_parameter(sources, name, f"optim.{key}")
            torch.save({"param": state, "cat_dim": 0}, os.path.join(folder, f"{key}.pt"))
        step = flat["scalars"].get("step")
        if step is not None:
            torch.save(scalar_value(step), os.path.join(folder, "step.pt"))
    for name, entry in manifest["module_tensors"].items():
        module[name] = sources.read_whole(name, entry).clone()
    _write_optimizer_state(manifest, groups, os.path.join(tmp, "zero", "optimizer_state.pt"))
    counters = manifest["counters"]
    client = restore_client_state(manifest["client_state"], read_client_tensors(sources, manifest)) or {}
    model_states = {
        "module": module,
        "buffer_names": list(manifest["module_tensors"]),
        "param_shapes": [dict(g) for g in groups if g],
        "frozen_param_shapes": frozen or None,
        "shared_params": dict(manifest.get("aliases", {})),
        "lr_scheduler": manifest.get("lr_scheduler"),
        "global_steps": counters["global_steps"],
        "global_samples": counters["global_samples"],
        "skipped_steps": counters["skipped_steps"],
        "dp_world_size": manifest["world_size"],
        "mp_world_size": 1,
        "ds_config": manifest.get("config"),
        "ds_version": DEEPSPEED_LAYOUT,
        **{k: v for k, v in client.items() if k not in ENGINE_KEYS},
    }
    if pipeline is not None:
        _write_pipeline(module, model_states, *pipeline, tmp)
        return
    for file in MODEL_STATES:  # DeepSpeed reads the first below stage 3, the second under stage 3
        torch.save(model_states, os.path.join(tmp, file))


def _pipeline_files(manifest: dict, stages: int) -> list:
    """The layers to write a file for, checked against the stage count before anything is written."""
    files = (manifest.get("pipeline") or {}).get("layer_files")
    if not files:
        raise CheckpointError(
            "pipeline_stages: this checkpoint is not a pipeline's, or was saved before zeroshard recorded which "
            "layers have files (load it in a pipeline engine and save it again)"
        )
    layers = manifest["pipeline"]["parts"][-1]
    if stages > layers:
        raise CheckpointError(f"pipeline_stages {stages}: the model has {layers} layers, fewer than the stages")
    return files


def _write_pipeline(module: dict, model_states: dict, stages: int, files: list, tmp: str) -> None:
    """DeepSpeed's pipeline files beside the universal folder (see :func:`write_universal_folder`)."""
    placed = set()
    for index, tie in files:
        prefix = f"tied_modules.{tie}." if tie else f"{index}."
        state = {name[len(prefix) :]: tensor for name, tensor in module.items() if name.startswith(prefix)}
        placed.update(prefix + name for name in state)
        torch.save(state, os.path.join(tmp, f"layer_{int(index):02d}-model_states.pt"))
    outside = sorted(set(module) - placed)
    if outside:
        raise CheckpointError(f"pipeline_stages: {outside[:3]} belong to no layer file (a pipeline's names do)")
    for stage in range(stages):
        torch.save({**model_states, "module": None, "mp_world_size": stages},
                   os.path.join(tmp, f"mp_rank_{stage:02d}_model_states.pt"))  # fmt: skip


def _flat_index(entry: dict) -> Optional[int]:
    match = re.fullmatch(r"fg(\d+)", entry["pieces"][0][1])
    return int(match.group(1)) if match else None


def _deepspeed_hyper(hyper: dict) -> dict:
    """The hyperparameters as DeepSpeed's optimizers hold them (betas a tuple); zeroshard's own flag for Adam's
    update rule stays in the ``zeroshard`` record (DeepSpeed's Adams take it from their config)."""
    return {k: tuple(v) if k == "betas" and isinstance(v, list) else v for k, v in hyper.items()
            if k != "decoupled_weight_decay"}  # fmt: skip


__all__ = ["export_universal_checkpoint", "write_universal_folder"]
