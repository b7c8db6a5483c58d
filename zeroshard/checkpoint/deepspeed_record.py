"""What DeepSpeed's checkpoints hold, as both readers return it and the converter writes it: the stand-ins for
DeepSpeed's classes its pickles name (:func:`read_deepspeed_file` reads them with torch's restricted unpickler), the
record of a checkpoint read whole (:class:`DeepSpeedCheckpoint`), DeepSpeed's optimizer settings in zeroshard's
vocabulary, and the zeroshard tensors and manifest an import writes. The readers of DeepSpeed's ZeRO rank files
(:mod:`.deepspeed_import`) and of its universal folders (:mod:`.deepspeed_universal`) import this module, and the
converter (:mod:`.deepspeed_convert`) imports all three; neither reader imports the other.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from .client_state import json_ready, split_client_state
from .manifest import FORMAT, rank_file
from .restricted_pickle import read_restricted_pickle
from .safetensors_io import CheckpointError


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
ENGINE_KEYS = {
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version",
    "checkpoint_parallel_dimensions", "autoep_layers", "compression_scheduler", "ds_autotp_meta",
}  # fmt: skip
# how torch ran the optimizer (kernels), not what it trains with: the importing run chooses its own
IMPLEMENTATION_KEYS = {"foreach", "fused", "capturable", "differentiable"}


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


def update_rule(path: str, config: dict, param_groups: list[dict]) -> Optional[str]:
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


def hyperparameters(path: str, g: int, group: dict, update_rule: Optional[str]) -> dict:
    """One parameter group's hyperparameters as zeroshard's optimizer names them. DeepSpeed's Adams add
    ``bias_correction`` (always on here: off is refused) and a group ``step`` (a counter, read as the group's step
    count); Adam or AdamW becomes torch's ``decoupled_weight_decay``, the flag zeroshard's Adams hold."""
    hyper = {k: v for k, v in group.items() if k != "params" and k not in IMPLEMENTATION_KEYS}
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
    "DEEPSPEED_CLASSES",
    "ENGINE_KEYS",
    "DeepSpeedCheckpoint",
    "hyperparameters",
    "imported_manifest",
    "imported_tensors",
    "plain_client_state",
    "read_deepspeed_file",
    "update_rule",
]
