"""Resolving ``"auto"`` values and the batch-size triad, recording every derived value.

DeepSpeed silently drops ``"auto"``; here each one is either resolved from something the caller
passed (the ``args`` namespace, the data loader, the model's width, the other batch keys) or
raises an error naming the key.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

from .elasticity import ElasticityIncompatibleWorldSize, elastic_batch
from .schema import ZeroshardConfig
from .section import ConfigError

# "auto" keys filled from attributes of the caller's ``args`` (HF TrainingArguments names first).
ARG_SOURCES: dict[str, tuple[str, ...]] = {
    "optimizer.params.lr": ("learning_rate", "lr"),
    "optimizer.params.weight_decay": ("weight_decay",),
    "optimizer.params.eps": ("adam_epsilon", "eps"),
    "optimizer.params.momentum": ("momentum",),
    "scheduler.params.warmup_max_lr": ("learning_rate", "lr"),
    "scheduler.params.cycle_max_lr": ("learning_rate", "lr"),
    "scheduler.params.warmup_min_lr": ("warmup_min_lr",),
    "scheduler.params.warmup_num_steps": ("warmup_steps", "warmup_num_steps"),
    "scheduler.params.total_num_steps": ("max_steps", "total_num_steps"),
    "gradient_clipping": ("max_grad_norm", "gradient_clipping"),
    "fp16.enabled": ("fp16",),
    "bf16.enabled": ("bf16",),
    "train_micro_batch_size_per_gpu": ("per_device_train_batch_size", "train_micro_batch_size_per_gpu"),
    "gradient_accumulation_steps": ("gradient_accumulation_steps",),
    "train_batch_size": ("train_batch_size",),
}

# "auto" keys that depend on the model's hidden size h (the formulas HF Transformers documents).
WIDTH_RULES = {
    "zero_optimization.reduce_bucket_size": lambda h: h * h,
    "zero_optimization.allgather_bucket_size": lambda h: h * h,
    "zero_optimization.prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "zero_optimization.param_persistence_threshold": lambda h: 10 * h,
}
# "auto" keys that DeepSpeed itself resolves to its default (it drops "auto" and keeps the field's default), as
# when a client passes them straight to initialize (OpenRLHF); the width rules fall back to these too.
DEEPSPEED_DEFAULT_FOR_AUTO = (
    *WIDTH_RULES,
    "zero_optimization.sub_group_size",
    "zero_optimization.max_live_parameters",
    "zero_optimization.max_reuse_distance",
)
# DeepSpeed's defaults where zeroshard's own differ (stage 3 keeps fewer units gathered unless asked)
DEEPSPEED_DEFAULTS = {"zero_optimization.max_reuse_distance": 1_000_000_000}


def _schema_default(key: str) -> Any:
    model: Any = ZeroshardConfig
    *sections, leaf = key.split(".")
    for name in sections:
        model = model.model_fields[name].annotation
    return model.model_fields[leaf].get_default(call_default_factory=True)


@dataclass(frozen=True)
class BatchTriad:
    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int


def resolve_batch_triad(
    train_batch_size: Optional[int], micro_batch_size: Optional[int], grad_accum: Optional[int], world_size: int
) -> BatchTriad:
    """Infer the missing members of train = micro x accumulation x data-parallel world, as DeepSpeed does."""
    tb, mb, ga, ws = train_batch_size, micro_batch_size, grad_accum, world_size
    if tb is not None and mb is not None and ga is not None:
        pass
    elif tb is not None and mb is not None:
        ga, rem = divmod(tb, mb * ws)
        if rem or ga == 0:
            raise ConfigError(
                f"train_batch_size {tb} is not divisible by train_micro_batch_size_per_gpu {mb} x world size {ws}; "
                f"set train_batch_size to a multiple of {mb * ws}"
            )
    elif tb is not None and ga is not None:
        mb, rem = divmod(tb, ga * ws)
        if rem or mb == 0:
            raise ConfigError(
                f"train_batch_size {tb} is not divisible by gradient_accumulation_steps {ga} x world size {ws}; "
                f"set train_batch_size to a multiple of {ga * ws}"
            )
    elif mb is not None:
        ga = ga or 1
        tb = mb * ga * ws
    elif tb is not None:
        ga = 1
        mb, rem = divmod(tb, ws)
        if rem or mb == 0:
            raise ConfigError(f"train_batch_size {tb} is not divisible by world size {ws}")
    else:
        raise ConfigError(
            "config needs 'train_batch_size' or 'train_micro_batch_size_per_gpu' "
            "(or both with 'gradient_accumulation_steps')"
        )
    if tb != mb * ga * ws:
        raise ConfigError(
            f"train_batch_size {tb} != train_micro_batch_size_per_gpu {mb} x gradient_accumulation_steps {ga} "
            f"x world size {ws} = {mb * ga * ws}; fix one of the three or drop train_batch_size to have it inferred"
        )
    return BatchTriad(tb, mb, ga)


@dataclass
class AutoContext:
    """What the caller gave that can resolve ``"auto"``."""

    world_size: int  # data-parallel ranks (the world over tensor- and sequence-parallel degrees)
    args: Any = None
    dataloader_batch_size: Optional[int] = None
    hidden_size: Optional[int] = None
    tensor_parallel_size: int = 1  # ranks of a tensor-parallel group, which share each batch
    sequence_parallel_size: int = 1  # ranks of a sequence-parallel group, which compute each sample together


@dataclass
class Resolution:
    config: ZeroshardConfig
    batch: BatchTriad
    derived: list[tuple[str, Any, str]] = field(default_factory=list)  # (key, value, where it came from)

    def report(self) -> str:
        width = max((len(k) for k, _, _ in self.derived), default=0)
        return "\n".join(f"  {k:<{width}} = {v!r}  ({src})" for k, v, src in self.derived)


def _from_args(ctx: AutoContext, key: str) -> tuple[bool, Any, str]:
    if ctx.args is None:
        return False, None, ""
    for attr in ARG_SOURCES.get(key, ()):
        value = getattr(ctx.args, attr, None)
        if value is not None:
            return True, value, f"args.{attr}"
    return False, None, ""


def _auto_value(key: str, ctx: AutoContext) -> tuple[bool, Any, str]:
    """What resolves an ``"auto"`` at ``key``: (found, value, its source), from the args, the model's width,
    DeepSpeed's defaults for auto, in that order."""
    found, value, source = _from_args(ctx, key)
    if not found and key in WIDTH_RULES and ctx.hidden_size:
        found, value, source = True, WIDTH_RULES[key](ctx.hidden_size), f"model hidden size {ctx.hidden_size}"
    if not found and key in DEEPSPEED_DEFAULT_FOR_AUTO:
        found, value, source = True, DEEPSPEED_DEFAULTS.get(key, _schema_default(key)), "DeepSpeed's default for auto"
    if not found and key == "scheduler.params.warmup_min_lr":
        found, value, source = True, 0.0, "default for auto"
    if not found and key == "optimizer.params.betas" and ctx.args is not None:
        b1, b2 = getattr(ctx.args, "adam_beta1", None), getattr(ctx.args, "adam_beta2", None)
        if b1 is not None and b2 is not None:
            found, value, source = True, [b1, b2], "args.adam_beta1/adam_beta2"
    return found, value, source


# keys whose "auto" is a setting of its own (DeepSpeed's default there), not a value to work out
AUTO_IS_A_SETTING = frozenset(
    {
        "data_types.keep_in_fp32_modules",  # the model's own fp32 lists
        "zero_optimization.offload_optimizer.ratio",  # as much optimizer state kept on the device as fits
    }
)


def _resolve_autos(node: dict, prefix: str, ctx: AutoContext, derived: list) -> None:
    """Every ``"auto"`` under ``node`` replaced by its value (the batch triad's by None: inferred afterwards)."""
    for leaf, value in list(node.items()):
        key = f"{prefix}{leaf}"
        if isinstance(value, dict):
            _resolve_autos(value, key + ".", ctx, derived)
        if value != "auto" or key in AUTO_IS_A_SETTING:
            continue
        found, value, source = _auto_value(key, ctx)
        if not found and (key.startswith("train_") or key == "gradient_accumulation_steps"):
            node[leaf] = None
            continue
        if not found:
            raise ConfigError(
                f"config key '{key}' is \"auto\" but nothing resolves it: pass it through args "
                f"({', '.join('args.' + a for a in ARG_SOURCES.get(key, ())) or 'no args attribute applies'}) "
                "or write a value in the config"
            )
        node[leaf] = value
        derived.append((key, value, source))


def _resolve_batch(config: ZeroshardConfig, data: dict, ctx: AutoContext, derived: list) -> BatchTriad:
    """The batch triad from what the config, elasticity, the data loader and the world give (written into
    ``data``)."""
    if config.elasticity.enabled:
        _elastic_triad(config.elasticity, data, ctx.world_size, derived)
    if (
        data["train_micro_batch_size_per_gpu"] is None
        and ctx.dataloader_batch_size
        and data["train_batch_size"] is None
    ):
        data["train_micro_batch_size_per_gpu"] = ctx.dataloader_batch_size
        derived.append(("train_micro_batch_size_per_gpu", ctx.dataloader_batch_size, "data loader batch size"))
    if ctx.sequence_parallel_size > 1 and data["sequence_parallel_size"] != ctx.sequence_parallel_size:
        data["sequence_parallel_size"] = ctx.sequence_parallel_size  # the mpu's group sets the degree in effect
        derived.append(("sequence_parallel_size", ctx.sequence_parallel_size, "the mpu's sequence-parallel group"))
    _all_ranks_counted(data, ctx, derived)
    batch = resolve_batch_triad(
        data["train_batch_size"],
        data["train_micro_batch_size_per_gpu"],
        data["gradient_accumulation_steps"],
        ctx.world_size,
    )
    for key, value in (
        ("train_batch_size", batch.train_batch_size),
        ("train_micro_batch_size_per_gpu", batch.micro_batch_size),
        ("gradient_accumulation_steps", batch.gradient_accumulation_steps),
    ):
        if data[key] != value:
            derived.append((key, value, f"batch triad with world size {ctx.world_size}"))
        data[key] = value
    return batch


def resolve_config(config: ZeroshardConfig, ctx: AutoContext) -> Resolution:
    data = config.model_dump(by_alias=False)
    derived: list[tuple[str, Any, str]] = []
    _resolve_autos(data, "", ctx, derived)
    batch = _resolve_batch(config, data, ctx, derived)
    zero = data["zero_optimization"]
    if zero["overlap_comm"] is None:
        zero["overlap_comm"] = zero["stage"] == 3  # DeepSpeed's dynamic default
        derived.append(("zero_optimization.overlap_comm", zero["overlap_comm"], "default for this stage"))
    derived.append(
        (
            "gradient_clipping",
            data["gradient_clipping"],
            "effective value; default 1.0 as in DeepSpeed since 0.19 (its PR #8068), 0 = off",
        )
    )
    resolved = ZeroshardConfig.model_validate(data)
    return Resolution(resolved, batch, derived)


def _all_ranks_counted(data: dict, ctx: AutoContext, derived: list) -> None:
    """Under tensor or sequence parallelism ``train_batch_size`` counts the data-parallel ranks only (as DeepSpeed
    documents): the ranks of a tensor-parallel group share each batch, those of a sequence-parallel group compute
    each sample together. A client that counted every rank (the HF Trainer fills ``world x micro x accumulation``)
    wrote a value ``tp x sp`` times too large: corrected, with a warning."""
    tb, mb, ga = data["train_batch_size"], data["train_micro_batch_size_per_gpu"], data["gradient_accumulation_steps"]
    tp, sp = ctx.tensor_parallel_size, ctx.sequence_parallel_size
    if tp * sp > 1 and None not in (tb, mb, ga) and tb == mb * ga * ctx.world_size * tp * sp:
        data["train_batch_size"] = mb * ga * ctx.world_size
        group = (
            f"the {tp} ranks of a tensor-parallel group share a batch"
            if tp > 1
            else (f"the {sp} ranks of a sequence-parallel group compute one sample")
        )
        why = f"{tb} counted all {ctx.world_size * tp * sp} ranks; {group}"
        derived.append(("train_batch_size", data["train_batch_size"], why))
        warnings.warn(f"train_batch_size {tb} -> {data['train_batch_size']}: {why}", stacklevel=3)


def _elastic_triad(block, data: dict, world_size: int, derived: list) -> None:
    """``elasticity``: the global batch comes from the block, the micro-batch and accumulation from the world size."""
    given = [
        k for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps") if data[k]
    ]
    if given and not block.ignore_non_elastic_batch_info:
        raise ConfigError(
            f"elasticity is enabled and the config also sets {given}; elasticity chooses the batch: remove them, or "
            'set "elasticity": {"ignore_non_elastic_batch_info": true} to let elasticity override them'
        )
    try:
        batch, sizes, micro = elastic_batch(block.model_dump(), world_size)
    except ElasticityIncompatibleWorldSize as err:
        raise ConfigError(
            f"elasticity: {err} (from min_gpus, max_gpus and num_gpus_per_node): start a valid number of ranks or "
            "change the elasticity block"
        ) from None
    accumulation = batch // (micro * world_size)
    data["train_batch_size"], data["train_micro_batch_size_per_gpu"] = batch, micro
    data["gradient_accumulation_steps"] = accumulation
    shown = f"{sizes[:12]}{' ...' if len(sizes) > 12 else ''}"
    source = f"elasticity: valid on world sizes {shown}, here {world_size}"
    derived += [
        ("train_batch_size", batch, source),
        ("train_micro_batch_size_per_gpu", micro, source),
        ("gradient_accumulation_steps", accumulation, source),
    ]


def model_hidden_size(module) -> Optional[int]:
    """The model's width: an HF-style ``config.hidden_size``/``n_embd``/``d_model``, else the widest Linear input."""
    cfg = getattr(module, "config", None)
    for attr in ("hidden_size", "n_embd", "d_model", "dim"):
        value = getattr(cfg, attr, None) if cfg is not None else None
        if isinstance(value, int):
            return value
    widths = [m.in_features for m in module.modules() if hasattr(m, "in_features")]
    return max(widths) if widths else None
