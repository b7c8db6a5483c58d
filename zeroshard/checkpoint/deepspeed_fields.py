"""DeepSpeed's checkpoint records checked field by field before anything is unpacked: every field the import reads
has the type, sign and size DeepSpeed writes, or the import stops with a :class:`CheckpointError` naming the file
and the field. An edit DeepSpeed's own loader would take silently (another ``lr`` on one rank, a negative
``exp_avg_sq``, an integer master) is refused too: the import would otherwise pick one rank's value or carry a state
no Adam step can produce.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .safetensors_io import CheckpointError

MAX_WORLD = 1 << 20
MAX_COUNTER = (1 << 63) - 1  # what the manifest's counters hold
MAX_NUMEL = 1 << 48
STATE_KEYS = ("exp_avg", "exp_avg_sq")


def _fail(path: str, field: str, value: Any, expected: str) -> CheckpointError:
    shown = f"{type(value).__name__} {tuple(value.shape)}" if torch.is_tensor(value) else repr(value)[:80]
    return CheckpointError(f"{path}: field '{field}' is {shown}; expected {expected}")


def _get(path: str, record: dict, key: str, field: str, kinds: tuple, expected: str, default: Any = ...) -> Any:
    if key not in record:
        if default is not ...:
            return default
        raise CheckpointError(f"{path}: field '{field}' is missing; expected {expected}")
    value = record[key]
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise _fail(path, field, value, expected)
    return value


def _count(path: str, record: dict, key: str, low: int, high: int, default: Any = ...) -> int:
    value = _get(path, record, key, key, (int,), f"an integer in [{low}, {high}]", default)
    if not low <= value <= high:
        raise _fail(path, key, value, f"an integer in [{low}, {high}]")
    return int(value)


@dataclass
class ModelStates:
    """What the import reads from ``mp_rank_00_model_states.pt`` (rank 0's under stage 3), checked."""

    world: int
    groups: list[list[tuple[str, tuple[int, ...]]]]  # per parameter group: (name, shape) in DeepSpeed's order
    buffers: dict[str, torch.Tensor]
    counters: dict[str, int]
    config: dict
    lr_scheduler: Optional[dict]
    aliases: dict[str, str]


def model_states(path: str, model: Any, module: Optional[dict] = None) -> ModelStates:
    """The checked fields of DeepSpeed's ``mp_rank_XX_model_states.pt``; ``module``: the weights where the file holds
    none (a pipeline stage's, ``module: None``: they are in its layer files)."""
    if not isinstance(model, dict) or "param_shapes" not in model:
        raise CheckpointError(f"{path}: not DeepSpeed model states (no 'param_shapes')")
    world = _count(path, model, "dp_world_size", 1, MAX_WORLD)
    groups = []
    for g, shapes in enumerate(_get(path, model, "param_shapes", "param_shapes", (list, tuple), "a list of dicts")):
        if not isinstance(shapes, dict) or not shapes:
            raise _fail(path, f"param_shapes[{g}]", shapes, "a non-empty dict of parameter name -> shape")
        groups.append([(name, _shape(path, f"param_shapes[{g}][{name!r}]", name, s)) for name, s in shapes.items()])
    seen = [name for group in groups for name, _ in group]
    if len(set(seen)) != len(seen):
        raise CheckpointError(f"{path}: field 'param_shapes' names a parameter twice")
    if module is None:
        module = _get(path, model, "module", "module", (dict,), "the module's state dict")
    buffers = {}
    for name in _get(path, model, "buffer_names", "buffer_names", (list, tuple), "a list of names", ()):
        if name in module:
            if not isinstance(name, str) or not dense(module[name]):
                raise _fail(path, f"module[{name!r}] (a buffer)", module[name], "a dense tensor")
            if module[name].is_floating_point() and bool(module[name].isnan().any()):
                raise CheckpointError(f"{path}: field 'module[{name!r}]' (a buffer) holds NaN; nothing imported")
            buffers[name] = module[name].float() if module[name].is_floating_point() else module[name]
    counters = {key: _count(path, model, key, 0, MAX_COUNTER, 0) for key in ("global_steps", "global_samples",
                                                                               "skipped_steps")}  # fmt: skip
    config = _get(path, model, "ds_config", "ds_config", (dict, type(None)), "a dict (the run's config)", None)
    scheduler = _get(path, model, "lr_scheduler", "lr_scheduler", (dict, type(None)), "a dict or None", None)
    shared = _get(path, model, "shared_params", "shared_params", (dict, type(None)), "a dict of name -> name", None)
    if any(not isinstance(a, str) or not isinstance(t, str) for a, t in (shared or {}).items()):
        raise _fail(path, "shared_params", shared, "a dict of parameter name -> parameter name")
    return ModelStates(world, groups, buffers, counters, dict(config or {}), scheduler, dict(shared or {}))


def _shape(path: str, field: str, name: Any, shape: Any) -> tuple[int, ...]:
    if not isinstance(name, str) or not name:
        raise _fail(path, field, name, "a parameter name")
    dims = tuple(shape) if isinstance(shape, (list, tuple, torch.Size)) else None
    if dims is None or any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in dims):
        raise _fail(path, field, shape, "a shape of non-negative integers")
    if math.prod(dims) > MAX_NUMEL:
        raise _fail(path, field, shape, f"at most {MAX_NUMEL} elements")
    if math.prod(dims) == 0:
        raise CheckpointError(
            f"{path}: field '{field}' is {list(dims)}, a parameter without elements, which a zeroshard checkpoint "
            "cannot hold (its pieces would be empty); nothing imported"
        )
    return dims


def dense(value: Any) -> bool:
    return torch.is_tensor(value) and value.layout == torch.strided and not value.is_meta


@dataclass
class RankRecord:
    """One rank's ``*zero_pp_rank_R_mp_rank_00_optim_states.pt``, checked against the model states' groups."""

    path: str
    stage: int
    inner: dict  # DeepSpeed's ``optimizer_state_dict``
    base: dict  # the wrapped optimizer's state dict: ``state`` and ``param_groups``
    masters: list[torch.Tensor]  # per parameter group, this rank's fp32 partition, flat
    steps: list[Optional[float]]  # per parameter group, its step count where this rank's file says one


def rank_record(path: str, data: Any, groups: list) -> RankRecord:
    if not isinstance(data, dict) or not isinstance(data.get("optimizer_state_dict"), dict):
        raise CheckpointError(f"{path}: not DeepSpeed optimizer states (no 'optimizer_state_dict')")
    inner = data["optimizer_state_dict"]
    stage = _count(path, inner, "zero_stage", 1, 3)
    masters_key, base_key = ("single_partition_of_fp32_groups", "base_optimizer_state") if stage < 3 else (
        "fp32_flat_groups", "optimizer_state_dict")  # fmt: skip
    if masters_key not in inner or base_key not in inner:
        raise CheckpointError(
            f"{path}: field 'zero_stage' is {stage} but the file has no '{masters_key}' / '{base_key}' (the layout "
            "of another stage): a damaged or edited file"
        )
    masters = _get(path, inner, masters_key, masters_key, (list, tuple), f"{len(groups)} tensor(s)")
    base = _get(path, inner, base_key, base_key, (dict,), "the optimizer's state dict")
    param_groups = _get(path, base, "param_groups", f"{base_key}.param_groups", (list, tuple), "a list of dicts")
    state = _get(path, base, "state", f"{base_key}.state", (dict,), "a dict of group index -> state")
    if len(masters) != len(groups) or len(param_groups) != len(groups):
        raise CheckpointError(
            f"{path}: {len(masters)} master partition(s) and {len(param_groups)} parameter group(s), but the model "
            f"states have {len(groups)} group(s)"
        )
    _check_layout_records(path, inner, len(groups))
    steps = []
    for g, master in enumerate(masters):
        field = f"{masters_key}[{g}]"
        if not dense(master) or not master.is_floating_point():
            raise _fail(path, field, master, "a dense floating-point tensor (the fp32 master partition)")
        if not bool(torch.isfinite(master).all()):
            raise CheckpointError(f"{path}: field '{field}' holds NaN or inf master weights")
        if not isinstance(param_groups[g], dict):
            raise _fail(path, f"{base_key}.param_groups[{g}]", param_groups[g], "a dict of hyperparameters")
        group_state = state.get(g, {})
        if not isinstance(group_state, dict):
            raise _fail(path, f"{base_key}.state[{g}]", group_state, "a dict of state tensors")
        for key in STATE_KEYS:
            _state_tensor(path, f"{base_key}.state[{g}][{key!r}]", group_state.get(key), master.numel(), key)
        steps.append(_step(path, base_key, g, group_state, param_groups[g]))
    return RankRecord(path, stage, inner, base, [m.float().reshape(-1) for m in masters], steps)


def _check_layout_records(path: str, inner: dict, groups: int) -> None:
    """The partition records :mod:`.deepspeed_ranks` compares with the layout: counts, paddings, fragments."""
    count = inner.get("partition_count")
    for c in count if isinstance(count, (list, tuple)) else [count]:
        if c is not None and (not isinstance(c, int) or isinstance(c, bool) or not 1 <= c <= MAX_WORLD):
            raise _fail(path, "partition_count", count, "the number of ranks (an integer, or one per group)")
    paddings = inner.get("param_alignment_paddings")
    if paddings is not None and (
        not isinstance(paddings, (list, tuple))
        or any(not isinstance(p, (list, tuple)) for p in paddings)
        or any(not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_NUMEL for p in paddings for n in p)
    ):
        raise _fail(path, "param_alignment_paddings", paddings, "per group, a list of non-negative integers")
    mappings = inner.get("param_slice_mappings")
    if isinstance(mappings, (list, tuple)):
        for g, group in enumerate(mappings[:groups]):
            if not isinstance(group, dict) or any(
                not isinstance(getattr(a, n, None), int) or getattr(a, n) < 0 for a in group.values()
                for n in ("start", "numel")
            ):  # fmt: skip
                raise _fail(path, f"param_slice_mappings[{g}]", group, "a dict of name -> fragment (start, numel)")


def _state_tensor(path: str, field: str, value: Any, numel: int, key: str) -> None:
    if value is None:
        raise CheckpointError(f"{path}: field '{field}' is missing: the optimizer has no '{key}' (not Adam?)")
    if not dense(value) or not value.is_floating_point() or value.numel() < numel:
        raise _fail(path, field, value, f"a dense floating-point tensor of at least {numel} elements")
    head = value.reshape(-1)[:numel]
    if not bool(torch.isfinite(head).all()):
        raise CheckpointError(f"{path}: field '{field}' holds NaN or inf")
    if key == "exp_avg_sq" and bool((head < 0).any()):
        raise CheckpointError(
            f"{path}: field '{field}' holds negative values; Adam's second moment is a mean of squares (an "
            "edited file?)"
        )


def _step(path: str, base_key: str, g: int, state: dict, group: dict) -> Optional[float]:
    for field, value in ((f"{base_key}.state[{g}]['step']", state.get("step")),
                         (f"{base_key}.param_groups[{g}]['step']", group.get("step"))):  # fmt: skip
        if value is not None:
            return step_count(path, field, value)
    return None


def step_count(path: str, field: str, value: Any) -> float:
    """A step count as DeepSpeed saves one (an int, a float or a one-element tensor), checked."""
    if torch.is_tensor(value) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_COUNTER:
        raise _fail(path, field, value, "a step count (a non-negative number)")
    if value != int(value):
        raise _fail(path, field, value, "a whole step count")
    return float(value)


def agreed_stage(path: str, ranks: list[RankRecord]) -> int:
    stages = {r.stage for r in ranks}
    if len(stages) != 1:
        raise CheckpointError(
            f"{path}: the rank files disagree on zero_stage ({sorted(stages)}): different runs' files"
        )
    return stages.pop()


def agreed_step(path: str, ranks: list[RankRecord], g: int) -> float:
    """Parameter group ``g``'s step count: every rank's file must say one, and the same one."""
    missing = [r.path for r in ranks if r.steps[g] is None]
    if missing:
        raise CheckpointError(f"{missing[0]}: parameter group {g}'s optimizer state has no 'step' (state or group)")
    steps = {r.steps[g] for r in ranks}
    if len(steps) != 1:
        raise CheckpointError(f"{path}: parameter group {g}'s optimizer step differs across ranks ({sorted(steps)})")
    return steps.pop()


def check_same_hyperparameters(path: str, ranks: list[RankRecord]) -> None:
    """Every rank ran each group with the same hyperparameters; a file that says otherwise was edited or mixed in
    from another run, and taking rank 0's value would hide it."""
    first = ranks[0].base["param_groups"]
    for rank in ranks[1:]:
        for g, group in enumerate(rank.base["param_groups"]):
            for key in sorted(set(group) | set(first[g]), key=str):
                if key in ("params", "step"):
                    continue
                a, b = first[g].get(key), group.get(key)
                same = torch.equal(a, b) if torch.is_tensor(a) and torch.is_tensor(b) else _plain_equal(a, b)
                if not same:
                    raise CheckpointError(
                        f"{rank.path}: parameter group {g}'s '{key}' is {b!r}, rank 0's is {a!r}: the ranks must "
                        "agree (an edited file or files of different runs); nothing imported"
                    )


def _plain_equal(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    try:
        return bool(a == b) and type(a) is type(b)
    except (RuntimeError, TypeError, ValueError):
        return False


__all__ = ["ModelStates", "RankRecord", "agreed_stage", "agreed_step", "check_same_hyperparameters", "model_states",
           "rank_record", "step_count"]  # fmt: skip
