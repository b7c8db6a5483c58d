"""Where each layer goes under tensor parallelism: pure decisions from the module tree, no communication.

Column-parallel layers split their output features (each rank computes some heads or some MLP
units), row-parallel layers split their input features (partial sums, all-reduced), and the
vocabulary embedding / LM head split the vocabulary. A column layer feeding a row layer needs no
communication in between, which is why attention q/k/v and MLP up/gate are column-parallel and
attention output / MLP down are row-parallel (Megatron-LM's layout).

Hugging Face ``Conv1D`` (GPT-2) stores its weight as (in, out); plans record that so the loader
slices the right dimension. GPT-2's ``c_attn`` packs q, k and v side by side (``fused=3``): each
third is split separately so every rank keeps whole heads of all three.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import Literal, Optional

from torch import nn

from ..config.patterns import MAX_WAYS, PatternCostError, match_ways

Style = Literal["column", "row", "vocab_embedding", "vocab_head"]

# Layer names of the supported architectures (GPT-2, Llama/Mistral/Qwen2, OPT) and common kin.
COLUMN_NAMES = {
    "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj",  # Llama family, OPT attention
    "c_attn", "c_fc",  # GPT-2
    "fc1", "fc_in", "w1", "w3", "wq", "wk", "wv", "query", "key", "value", "dense_h_to_4h",
}  # fmt: skip
ROW_NAMES = {"o_proj", "down_proj", "out_proj", "c_proj", "fc2", "fc_out", "w2", "wo", "dense_4h_to_h"}
FUSED = {"c_attn": 3}  # column layers whose output packs several projections side by side
REPLICATED_NAMES = {"project_in", "project_out"}  # OPT's small embedding-width projections
HEAD_COUNT_ATTRIBUTES = ("num_heads", "num_attention_heads", "num_key_value_heads", "n_head", "n_heads", "n_kv_heads")
WIDTH_ATTRIBUTES = ("embed_dim", "split_size", "all_head_size")  # per-rank width the attention code reads


class PlacementError(ValueError):
    """A layer or head count that cannot be split over the requested ranks; names the layer and the fix."""


@dataclass(frozen=True)
class LayerPlan:
    name: str  # module path in the model
    style: Style
    fused: int = 1
    transposed: bool = False  # weight stored (in, out), as HF Conv1D does


@dataclass(frozen=True)
class TensorParallelPlan:
    layers: list[LayerPlan]
    attention: list[str]  # modules whose head-count / width attributes become per-rank values
    tp_size: int
    # replicated modules applied to this rank's heads only (Qwen3's per-head q_norm / k_norm): in training each
    # rank's gradient for their parameters is a partial sum, summed over the group
    grad_allreduce: tuple[str, ...] = ()


def is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or _is_conv1d(module)


def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")  # transformers.pytorch_utils.Conv1D


def features(module: nn.Module) -> tuple[int, int]:
    """(in, out) features of a linear layer of either weight layout."""
    rows, cols = module.weight.shape
    return (rows, cols) if _is_conv1d(module) else (cols, rows)


def split_range(size: int, parts: int, index: int, what: str) -> tuple[int, int]:
    """Rank ``index``'s [start, stop) of ``size`` split evenly into ``parts``."""
    if size % parts:
        raise PlacementError(f"{what}: {size} is not divisible by tp_size {parts}")
    per = size // parts
    return index * per, (index + 1) * per


def vocab_range(vocab: int, parts: int, index: int) -> tuple[int, int, int]:
    """Rank ``index``'s rows [start, stop) of a vocabulary split into ``parts`` equal padded slices of ``per``
    rows (the last slice may hold fewer real rows; its padding rows are zero and their logits dropped)."""
    per = -(-vocab // parts)
    start = min(index * per, vocab)
    return start, min(start + per, vocab), per


@dataclass(frozen=True)
class LayerSpec:
    """One ``tensor_parallel.partition_config.layer_specs`` entry (DeepSpeed's ``TPLayerSpec``): modules whose name
    (or ``<name>.weight``) a pattern matches are split as ``style``; ``skip`` leaves them replicated, with
    ``grad_allreduce`` summing their gradients over the group (they act on this rank's heads only)."""

    patterns: tuple[str, ...]
    style: Literal["column", "row", "skip"]
    fused: int = 1
    grad_allreduce: bool = False
    model_types: Optional[tuple[str, ...]] = None

    def matches(self, name: str, model_type: Optional[str]) -> bool:
        if self.model_types is not None and (model_type or "").lower() not in {t.lower() for t in self.model_types}:
            return False
        for pattern in self.patterns:  # the config checked them at NAME_LENGTH; a longer name is checked here
            if match_ways(pattern, len(name) + len(".weight")) > MAX_WAYS:
                raise PatternCostError(
                    f"tensor_parallel layer_specs pattern {pattern!r} could backtrack in more than {MAX_WAYS:.0e} "
                    f"ways on module name {name[:60]!r}{'...' if len(name) > 60 else ''} ({len(name)} characters); "
                    "use fewer unbounded repeats ('.*', '\\d+') in it"
                )
        return any(re.match(p, name) or re.match(p, f"{name}.weight") for p in self.patterns)


# DeepSpeed's ``preset_model`` layouts zeroshard has: attention and MLP of the Llama / Qwen2 families.
SEPARATE_PROJECTIONS = (
    LayerSpec((r".*\.self_attn\.o_proj$", r".*\.mlp\.down_proj$"), "row"),
    LayerSpec((r".*\.self_attn\.[qkv]_proj$", r".*\.mlp\.(up|gate)_proj$"), "column"),
)
PRESETS = {"llama": SEPARATE_PROJECTIONS, "qwen2": SEPARATE_PROJECTIONS}


def layer_specs_from(tensor_parallel) -> tuple[LayerSpec, ...]:
    """The layer specs of a ``tensor_parallel`` config block (``zeroshard.config`` validated it): the
    ``partition_config`` ones, then those of ``preset_model``."""
    specs = tuple(
        LayerSpec(
            tuple(spec.patterns),
            spec.partition_type,
            spec.fused,
            spec.grad_allreduce,
            tuple(spec.model_types) if spec.model_types is not None else None,
        )
        for spec in tensor_parallel.partition_config.layer_specs
    )
    preset = tensor_parallel.preset_model
    return specs + (PRESETS[preset.lower()] if preset is not None else ())


# Hugging Face ``base_model_tp_plan`` styles and what they are here (in training the gathered column layer of
# ``colwise_rep``, an LM head, is replicated: the same product without the gather).
HF_STYLES = {"colwise": "column", "rowwise": "row", "colwise_rep": "skip", "replicated_with_grad_allreduce": "skip"}


def plan_tensor_parallel(
    model: nn.Module,
    tp_size: int,
    injection_policy: Optional[dict] = None,
    vocab_parallel_min_bytes: int = 0,
    layer_specs: tuple[LayerSpec, ...] = (),
    use_default_specs: bool = True,
    split_vocabulary: bool = True,
) -> TensorParallelPlan:
    """Place every linear layer: by ``layer_specs`` first (``partition_config``), then (``use_default_specs``) by the
    model's Hugging Face ``base_model_tp_plan``, then by the known layer names (automatic); or by
    ``injection_policy`` = ``{BlockClass or class name: (row-parallel layer paths inside the block)}`` (every other
    linear layer inside such a block is column-parallel, layers outside all blocks stay replicated). Without
    ``split_vocabulary`` (training) the embedding and LM head stay replicated."""
    _check_head_counts(model, tp_size)
    _check_match_cost(model, layer_specs)
    names = {id(m): n for n, m in model.named_modules()}
    vocab = _vocab_layers(model, names)
    weights = {name: model.get_submodule(name).weight for name in vocab}
    layers = [  # smaller vocabulary layers stay replicated
        LayerPlan(name, style)
        for name, style in vocab.items()
        if split_vocabulary and weights[name].numel() * weights[name].element_size() >= vocab_parallel_min_bytes
    ]
    grad_allreduce = _grad_allreduce_modules(model, layer_specs, use_default_specs)
    if use_default_specs:
        _check_hf_plan(model, layer_specs)
    if injection_policy is None:
        layers += _automatic(model, set(vocab), layer_specs, use_default_specs)
        if layer_specs:
            _check_spec_placement(model, layers, layer_specs)
    else:
        layers += _from_policy(model, injection_policy, set(vocab))
    for plan in layers:
        _check_divisible(model.get_submodule(plan.name), plan, tp_size)
    column_parents = {plan.name.rpartition(".")[0] for plan in layers if plan.style == "column"}
    attention = [
        parent
        for parent in sorted(column_parents)
        if any(isinstance(getattr(model.get_submodule(parent), a, None), int) for a in HEAD_COUNT_ATTRIBUTES)
    ]
    for parent in attention:
        module = model.get_submodule(parent)
        for attribute in (*HEAD_COUNT_ATTRIBUTES, *WIDTH_ATTRIBUTES):
            value = getattr(module, attribute, None)
            if isinstance(value, int) and not isinstance(value, bool) and value % tp_size:
                raise PlacementError(
                    f"{parent}.{attribute} = {value} is not divisible by tp_size {tp_size}: "
                    "choose a tp_size that divides the head count"
                )
    return TensorParallelPlan(layers=layers, attention=attention, tp_size=tp_size, grad_allreduce=grad_allreduce)


def _hf_plan(model: nn.Module) -> list[tuple[re.Pattern, str, str]]:
    """A Hugging Face model's own tensor-parallel plan (``config.base_model_tp_plan``) as (module-name pattern,
    style here, the plan's entry); its keys are relative to the base model and use ``*`` for a layer index. An
    entry of a style zeroshard does not implement is refused by name when a module of the model matches it."""
    tp_plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
    return [
        (re.compile(r"(?:^|.*\.)" + re.escape(key).replace(r"\*", r"\d+") + "$"), HF_STYLES.get(style, ""), key)
        for key, style in tp_plan.items()
    ]


def _model_type(model: nn.Module) -> Optional[str]:
    return getattr(getattr(model, "config", None), "model_type", None)


def _hf_style(model: nn.Module, name: str, hf_plan) -> Optional[str]:
    for pattern, style, key in hf_plan:
        if pattern.match(name):
            if not style:
                raw = model.config.base_model_tp_plan[key]
                raise PlacementError(
                    f"module '{name}': the model's base_model_tp_plan entry '{key}': '{raw}' is a style zeroshard does "
                    f"not implement (it does {sorted(HF_STYLES)}); place the layer with "
                    "tensor_parallel.partition_config.layer_specs"
                )
            return style
    return None


# every module name may be matched against every pattern in each of the placement's passes (the model's own plan,
# gradient all-reduces, the linear layers, the spec check), as its name and as '<name>.weight'
MATCH_PASSES = 4 * 2
MAX_TOTAL_WAYS = 10 * MAX_WAYS  # about ten seconds of the slowest backtracking, for the whole model


def _check_match_cost(model: nn.Module, layer_specs: tuple[LayerSpec, ...]) -> None:
    """Each pattern is bounded on its own (the config checks it); this bounds them together over the model's
    module names, before any runs: eight copies of one slow pattern once made a one-layer Llama's ``initialize``
    take 279 s."""
    patterns = [p for spec in layer_specs for p in spec.patterns]
    if not patterns:
        return
    names = [name for name, _ in model.named_modules() if name]
    total = MATCH_PASSES * sum(match_ways(p, len(n) + len(".weight")) for p in patterns for n in names)
    if total > MAX_TOTAL_WAYS:
        raise PatternCostError(
            f"tensor_parallel layer_specs: {len(patterns)} pattern(s) against {len(names)} module names could "
            f"backtrack in {total:.1e} ways together (at most {MAX_TOTAL_WAYS:.0e}, some seconds of matching): use "
            "fewer patterns, or fewer unbounded repeats ('.*', '\\d+') in them, anchored on the names' dots"
        )


def _check_hf_plan(model: nn.Module, layer_specs: tuple[LayerSpec, ...]) -> None:
    """Every module the model's own plan places in a style zeroshard lacks (Mixtral's experts: ``moe_tp_experts``,
    ``packed_colwise``) is refused by name, unless a layer spec places it: it is never silently replicated."""
    hf_plan, model_type = _hf_plan(model), _model_type(model)
    for name, _ in model.named_modules():
        if name and not any(spec.matches(name, model_type) for spec in layer_specs):
            _hf_style(model, name, hf_plan)


def _grad_allreduce_modules(
    model: nn.Module, layer_specs: tuple[LayerSpec, ...], use_default_specs: bool
) -> tuple[str, ...]:
    """Replicated modules applied to this rank's heads only: a layer spec's ``grad_allreduce``, or the model's own
    plan's ``replicated_with_grad_allreduce`` (Qwen3's per-head ``q_norm`` / ``k_norm``)."""
    tp_plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
    hf_plan = _hf_plan(model) if use_default_specs else []
    hf = [p for p, _, key in hf_plan if tp_plan[key] == "replicated_with_grad_allreduce"]
    model_type = _model_type(model)
    found = []
    for name, _ in model.named_modules():
        spec = next((s for s in layer_specs if s.matches(name, model_type)), None) if name else None
        if spec.grad_allreduce if spec is not None else any(p.match(name) for p in hf):
            found.append(name)
    return tuple(found)


def _check_head_counts(model: nn.Module, tp_size: int) -> None:
    config = getattr(model, "config", None)
    for key in ("num_attention_heads", "num_key_value_heads", "n_head"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value % tp_size:
            raise PlacementError(
                f"{type(config).__name__}.{key} = {value} is not divisible by tp_size {tp_size}: every rank must "
                "hold whole attention heads (and whole key/value heads with grouped-query attention)"
            )


def _vocab_layers(model: nn.Module, names: dict[int, str]) -> dict[str, Style]:
    """Hugging Face models name their input embedding and LM head: the layers that may split the vocabulary."""
    found: dict[str, Style] = {}
    for getter, style in (("get_input_embeddings", "vocab_embedding"), ("get_output_embeddings", "vocab_head")):
        try:
            module = getattr(model, getter)() if hasattr(model, getter) else None
        except (NotImplementedError, AttributeError):
            module = None
        if module is None or id(module) not in names:
            continue
        if style == "vocab_embedding" and type(module) is not nn.Embedding:
            continue  # e.g. a scaled or custom embedding: left replicated
        if style == "vocab_head" and type(module) is not nn.Linear:
            continue
        found[names[id(module)]] = style
    return found


def _automatic(
    model: nn.Module, skip: set[str], layer_specs: tuple[LayerSpec, ...] = (), use_default_specs: bool = True
) -> list[LayerPlan]:
    plans = []
    hf_plan, model_type = _hf_plan(model) if use_default_specs else [], _model_type(model)
    for name, module in model.named_modules():
        if name in skip or not is_linear(module):
            continue
        spec = next((s for s in layer_specs if s.matches(name, model_type)), None)
        style = spec.style if spec is not None else _hf_style(model, name, hf_plan)
        if style is not None:
            if style != "skip":
                fused = spec.fused if spec is not None else FUSED.get(name.rpartition(".")[2], 1)
                plans.append(LayerPlan(name, style, fused, _is_conv1d(module)))
            continue
        if not use_default_specs:
            continue  # only the layer specs place layers; the others stay replicated
        leaf = name.rpartition(".")[2]
        if leaf in COLUMN_NAMES:
            plans.append(LayerPlan(name, "column", FUSED.get(leaf, 1), _is_conv1d(module)))
        elif leaf in ROW_NAMES:
            plans.append(LayerPlan(name, "row", 1, _is_conv1d(module)))
        elif leaf not in REPLICATED_NAMES:
            fan_in, fan_out = features(module)
            raise PlacementError(
                f"cannot place layer '{name}' ({type(module).__name__} {fan_in}->{fan_out}) for tensor parallelism: "
                "its role is not known; in training place it with tensor_parallel.partition_config.layer_specs "
                "(partition_type column, row or skip), for init_inference pass injection_policy={BlockClass: "
                "('<row-parallel layer>', ...)} naming the layers whose outputs are summed (attention output, MLP "
                "down projection)"
            )
    return plans


def _check_spec_placement(model: nn.Module, layers: list[LayerPlan], layer_specs: tuple[LayerSpec, ...]) -> None:
    """What user layer specs can get wrong, said at ``initialize`` instead of at the first forward: a block left
    with column-parallel layers and no row-parallel one to join their split outputs (or the reverse) cannot run; a
    spec that matches a module which is not a linear layer (an embedding, a norm, the LM head) is ignored, and said
    so. (A spec that splits the wrong layer of a consistent block, e.g. ``q_proj`` as row, is caught by the forward
    :func:`~zeroshard.tensor_parallel.shard.check_forward` runs after the split.)"""
    model_type = _model_type(model)
    styles: dict[str, dict[str, list[str]]] = {}
    for plan in layers:
        if plan.style in ("column", "row"):
            parent, _, leaf = plan.name.rpartition(".")
            styles.setdefault(parent, {"column": [], "row": []})[plan.style].append(leaf)
    for parent, found in styles.items():
        if not found["column"] or not found["row"]:
            only, other = ("column", "row") if found["column"] else ("row", "column")
            raise PlacementError(
                f"tensor_parallel.partition_config.layer_specs leave '{parent or '<root>'}' with {only}-parallel "
                f"layers {found[only]} and no {other}-parallel layer: a column layer's split output must be joined "
                "by a row layer of the same block (attention q/k/v column with o_proj row; MLP up/gate column with "
                "down row); fix the specs' patterns"
            )
    planned = {plan.name for plan in layers}
    ignored = [
        f"{name} ({type(module).__name__})"
        for name, module in model.named_modules()
        if name not in planned
        and any(True for _ in module.parameters(recurse=False))
        and any(spec.style != "skip" and spec.matches(name, model_type) for spec in layer_specs)
    ]
    if ignored:
        warnings.warn(
            f"tensor_parallel.partition_config.layer_specs match {ignored[:8]}{' ...' if len(ignored) > 8 else ''}, "
            "which stay replicated: only linear layers are split in training (the embedding and LM head stay whole)",
            stacklevel=3,
        )


def _from_policy(model: nn.Module, policy: dict, skip: set[str]) -> list[LayerPlan]:
    plans, matched = [], set()
    for block_name, block in model.named_modules():
        key = next((k for k in policy if _matches(block, k)), None)
        if key is None:
            continue
        matched.add(key)
        rows = policy[key]
        rows = (rows,) if isinstance(rows, str) else tuple(rows)
        for row in rows:
            try:
                layer = block.get_submodule(row)
            except AttributeError:
                layer = None
            if layer is None or not is_linear(layer):
                raise PlacementError(
                    f"injection_policy for {type(block).__name__}: '{row}' is not a linear layer of '{block_name}'"
                )
        for name, module in block.named_modules():
            full = f"{block_name}.{name}" if block_name else name
            if name and is_linear(module) and full not in skip:
                style: Style = "row" if name in rows else "column"
                plans.append(LayerPlan(full, style, 1, _is_conv1d(module)))
    missing = [k for k in policy if k not in matched]
    if missing:
        raise PlacementError(f"injection_policy names {missing} but the model has no such block")
    return plans


def _matches(module: nn.Module, key) -> bool:
    return type(module) is key if isinstance(key, type) else type(module).__name__ == key


def _check_divisible(module: nn.Module, plan: LayerPlan, tp_size: int) -> None:
    fan_in, fan_out = features(module)
    if plan.style == "column":
        if fan_out % plan.fused or (fan_out // plan.fused) % tp_size:
            raise PlacementError(
                f"column-parallel layer '{plan.name}' has {fan_out} output features"
                f"{f' in {plan.fused} fused parts' if plan.fused > 1 else ''}, not divisible by tp_size {tp_size}"
            )
    elif plan.style == "row" and fan_in % tp_size:
        raise PlacementError(
            f"row-parallel layer '{plan.name}' has {fan_in} input features, not divisible by tp_size {tp_size}"
        )
