"""Placement decisions are pure: checked on real model classes without processes."""

import re

import pytest
import torch
import transformers
from torch import nn

from zeroshard.config.inference import parse_inference_config
from zeroshard.tensor_parallel import PlacementError, plan_tensor_parallel
from zeroshard.tensor_parallel.placement import HF_STYLES, vocab_range


def gpt2(n_head=4):
    cfg = transformers.GPT2Config(n_layer=2, n_embd=48, n_head=n_head, vocab_size=101, n_positions=32)
    return transformers.GPT2LMHeadModel(cfg)


def llama(heads=8, kv_heads=2):
    cfg = transformers.LlamaConfig(
        num_hidden_layers=1,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=64,
    )
    return transformers.LlamaForCausalLM(cfg)


def test_gpt2_layers_placed_by_role():
    plan = plan_tensor_parallel(gpt2(), 2)
    styles = {p.name: (p.style, p.fused, p.transposed) for p in plan.layers}
    assert styles["transformer.wte"][0] == "vocab_embedding" and styles["lm_head"][0] == "vocab_head"
    assert styles["transformer.h.0.attn.c_attn"] == ("column", 3, True)  # q|k|v packed in one Conv1D
    assert styles["transformer.h.0.attn.c_proj"] == ("row", 1, True)
    assert styles["transformer.h.1.mlp.c_fc"][0] == "column" and styles["transformer.h.1.mlp.c_proj"][0] == "row"
    assert "transformer.wpe" not in styles  # position embeddings stay replicated
    assert plan.attention == ["transformer.h.0.attn", "transformer.h.1.attn"]


def test_llama_grouped_query_attention():
    plan = plan_tensor_parallel(llama(), 2)
    styles = {p.name.rpartition(".")[2]: p.style for p in plan.layers}
    assert {k: styles[k] for k in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")} == dict.fromkeys(
        ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"), "column"
    )
    assert styles["o_proj"] == styles["down_proj"] == "row"
    with pytest.raises(PlacementError, match=r"num_key_value_heads = 2 is not divisible by tp_size 4"):
        plan_tensor_parallel(llama(kv_heads=2), 4)


def test_head_count_not_divisible_names_it():
    with pytest.raises(PlacementError, match=r"num_attention_heads = 6 is not divisible by tp_size 4"):
        plan_tensor_parallel(gpt2(n_head=6), 4)


class Odd(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(8, 8)
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)


def test_unknown_layer_is_named():
    with pytest.raises(PlacementError, match=r"cannot place layer 'router' \(Linear 8->8\).*injection_policy"):
        plan_tensor_parallel(Odd(), 2)


def test_injection_policy():
    plan = plan_tensor_parallel(nn.Sequential(Odd()), 2, injection_policy={Odd: ("fc2",)})
    assert {p.name: p.style for p in plan.layers} == {"0.router": "column", "0.fc1": "column", "0.fc2": "row"}
    plan = plan_tensor_parallel(nn.Sequential(Odd()), 2, injection_policy={"Odd": "fc2"})  # class name, one layer
    assert len(plan.layers) == 3
    with pytest.raises(PlacementError, match=r"'fc3' is not a linear layer of '0'"):
        plan_tensor_parallel(nn.Sequential(Odd()), 2, injection_policy={Odd: ("fc3",)})
    with pytest.raises(PlacementError, match=r"names \['Block'\] but the model has no such block"):
        plan_tensor_parallel(Odd(), 2, injection_policy={"Block": ("fc2",)})
    with pytest.raises(PlacementError, match=r"column-parallel layer '0.router' has 8 output features"):
        plan_tensor_parallel(nn.Sequential(Odd()), 3, injection_policy={Odd: ("fc2",)})


def test_small_vocabulary_stays_replicated_below_threshold():
    model = gpt2()
    plan = plan_tensor_parallel(model, 2, vocab_parallel_min_bytes=model.lm_head.weight.numel() * 4 + 1)
    assert not any(p.style.startswith("vocab") for p in plan.layers)


@pytest.mark.parametrize("vocab,parts", [(101, 2), (101, 4), (8, 4), (5, 4)])
def test_vocab_ranges_cover_the_vocabulary_once(vocab, parts):
    ranges = [vocab_range(vocab, parts, i) for i in range(parts)]
    assert [r[2] for r in ranges] == [-(-vocab // parts)] * parts
    covered = [i for start, stop, _ in ranges for i in range(start, stop)]
    assert covered == list(range(vocab))


def test_config_keys_and_aliases():
    assert parse_inference_config({"tensor_parallel": {"tp_size": 2}, "dtype": "bf16"}).dtype is torch.bfloat16
    assert parse_inference_config(None, mp_size=4).tp_size == 4
    assert parse_inference_config({"tensor_parallel": {"tp_size": 2}}, tensor_parallel=4).tp_size == 4
    assert parse_inference_config({"tensor_parallel": {"tp_size": 2, "enabled": False}}).tp_size == 1
    with pytest.raises(ValueError, match=r"unknown config key 'tensor_paralel'; did you mean 'tensor_parallel'"):
        parse_inference_config({"tensor_paralel": {"tp_size": 2}})
    with pytest.raises(ValueError, match=r"unknown config key 'tensor_parallel.tp'"):
        parse_inference_config({"tensor_parallel": {"tp": 2}})
    with pytest.raises(ValueError, match=r"mp_size=2 and tensor_parallel.tp_size=4 disagree"):
        parse_inference_config({"tensor_parallel": {"tp_size": 4}, "mp_size": 2})
    with pytest.raises(ValueError, match=r"'dtype' = 'int8'.*unknown dtype"):
        parse_inference_config(None, dtype="int8")
    with pytest.raises(ValueError, match=r"replace_with_kernel_inject.*no fused inference kernels"):
        parse_inference_config({"replace_with_kernel_inject": True})


def test_modules_hf_marks_replicated_with_grad_allreduce_are_listed():
    from zeroshard.tensor_parallel.placement import plan_tensor_parallel
    from zeroshard.testing.hf import tiny_causal_lm

    plan = plan_tensor_parallel(tiny_causal_lm("qwen3"), 2)
    assert plan.grad_allreduce == tuple(
        f"model.layers.{i}.self_attn.{norm}" for i in range(2) for norm in ("q_norm", "k_norm")
    )


class Custom(nn.Module):
    """Layer names no placement knows: only layer specs place them."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.mix = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(8)
        self.router = nn.Linear(16, 4)


def _specs(tensor_parallel: dict):
    from zeroshard.config import parse_config
    from zeroshard.tensor_parallel import layer_specs_from

    block = parse_config({"train_batch_size": 1, "tensor_parallel": tensor_parallel}).tensor_parallel
    return layer_specs_from(block), block.partition_config.use_default_specs


def test_layer_specs_place_what_the_names_do_not():
    specs, default = _specs(
        {
            "autotp_size": 2,
            "partition_config": {
                "use_default_specs": False,
                "layer_specs": [
                    {"patterns": [r".*qkv\.weight$"], "partition_type": "column", "shape": [3, -1], "partition_dim": 0},
                    {"patterns": [r"^mix$"], "partition_type": "ROW"},
                    {"patterns": [r"^norm$"], "partition_type": "skip", "grad_allreduce": True},
                ],
            },
        }
    )
    plan = plan_tensor_parallel(Custom(), 2, layer_specs=specs, use_default_specs=default, split_vocabulary=False)
    assert {(p.name, p.style, p.fused) for p in plan.layers} == {("qkv", "column", 3), ("mix", "row", 1)}
    assert plan.grad_allreduce == ("norm",)  # the router, matched by nothing, stays replicated
    with pytest.raises(PlacementError, match="cannot place layer 'qkv'"):  # without the specs: named
        plan_tensor_parallel(Custom(), 2)


def test_a_preset_places_the_llama_layout():
    block = {"autotp_size": 2, "preset_model": "llama", "partition_config": {"use_default_specs": False}}
    specs, default = _specs(block)
    plan = plan_tensor_parallel(llama(), 2, layer_specs=specs, use_default_specs=default, split_vocabulary=False)
    styles = {p.name.rpartition(".")[2]: p.style for p in plan.layers}
    assert styles == {"q_proj": "column", "k_proj": "column", "v_proj": "column", "o_proj": "row",
                      "gate_proj": "column", "up_proj": "column", "down_proj": "row"}  # fmt: skip


def test_a_models_own_plan_style_zeroshard_lacks_is_named():
    """Read from the plan the installed transformers ships: Mixtral's experts were ``moe_tp_experts`` in its
    ``base_model_tp_plan`` before transformers 5 moved them to ``base_model_ep_plan``. A style zeroshard lacks is
    refused by name; the plan's other entries are placed; a planted unknown style is named on every version."""
    from zeroshard.testing.hf import tiny_causal_lm

    mixtral = tiny_causal_lm("mixtral", num_attention_heads=4, num_key_value_heads=2)
    shipped = dict(mixtral.config.base_model_tp_plan or {})
    lacking = {key: style for key, style in shipped.items() if style not in HF_STYLES}
    if lacking:
        key = next(iter(lacking))
        with pytest.raises(PlacementError, match=f"base_model_tp_plan entry '{re.escape(key)}': '{lacking[key]}'"):
            plan_tensor_parallel(mixtral, 2, split_vocabulary=False)
    else:
        plan = plan_tensor_parallel(mixtral, 2, split_vocabulary=False)
        placed = {p.name.split("layers.", 1)[1].split(".", 1)[1]: p.style for p in plan.layers}
        wanted = {key.split(".", 2)[2]: HF_STYLES[style] for key, style in shipped.items() if "layers.*" in key}
        assert placed == {k: v for k, v in wanted.items() if v != "skip"}
    planted = tiny_causal_lm("llama", num_attention_heads=4, num_key_value_heads=2)
    planted.config.base_model_tp_plan = {**planted.config.base_model_tp_plan, "layers.*.mlp.up_proj": "packed_colwise"}
    with pytest.raises(PlacementError, match=r"entry 'layers\.\*\.mlp\.up_proj': 'packed_colwise' is a style"):
        plan_tensor_parallel(planted, 2, split_vocabulary=False)


def test_training_keeps_the_vocabulary_replicated():
    plan = plan_tensor_parallel(gpt2(), 2, split_vocabulary=False)
    assert not {"transformer.wte", "lm_head"} & {p.name for p in plan.layers}


@pytest.mark.parametrize(
    "pattern,refused",
    [
        ("(.*.*)*Z", True),  # nested unbounded repeats: exponential on a failing match
        ("(a|aa)*b", True),  # alternatives under an unbounded repeat
        ("(a+)+$", True),
        ("x" * 600, True),  # longer than any module name pattern needs
        (r".*\.self_attn\.[qkv]_proj$", False),
        (r".*\.mlp\.(up|gate)_proj$", False),
        (r"model\.layers\.\d+\.(q|k)_proj", False),
    ],
)
def test_layer_spec_patterns_that_backtrack_without_bound_are_refused(pattern, refused):
    """Python's re has no time limit; a spec's pattern is matched against every module name at initialize."""
    from zeroshard.config import parse_config

    block = {"autotp_size": 2, "partition_config": {"layer_specs": [{"patterns": [pattern]}]}}
    config = {"train_micro_batch_size_per_gpu": 1, "tensor_parallel": block}
    if refused:
        with pytest.raises(ValueError, match="can take exponential time to match|characters long; at most 512"):
            parse_config(config)
    else:
        parse_config(config)


def test_many_accepted_patterns_together_are_bounded_before_any_runs():
    """Each of these is accepted on its own; eight of them over a Llama's module names in every placement pass
    could backtrack far more (a red team's eight slow copies made initialize take 279 s): refused by name, fast."""
    from zeroshard.config.patterns import PatternCostError, check_pattern
    from zeroshard.tensor_parallel.placement import LayerSpec, plan_tensor_parallel
    from zeroshard.testing.hf import tiny_causal_lm

    slow = r"(?:a|a){1,18}Z"  # a bounded repeat of two alternatives: 18 x 2^18 ways on any name, accepted alone
    check_pattern(slow)
    model = tiny_causal_lm("llama")
    with pytest.raises(PatternCostError, match=r"8 pattern\(s\) against \d+ module names could backtrack"):
        plan_tensor_parallel(model, 2, layer_specs=(LayerSpec((slow,) * 8, "column"),))  # refused before matching
    three_repeats = (r".*.*.*Z",) * 8  # heavier than any real spec, still within the budget on this model
    plan_tensor_parallel(model, 2, layer_specs=(LayerSpec(three_repeats, "column"),))
    plain = plan_tensor_parallel(model, 2, layer_specs=(LayerSpec((r".*\.self_attn\.[qkv]_proj$",), "column"),))
    assert any(layer.name.endswith("q_proj") for layer in plain.layers)
