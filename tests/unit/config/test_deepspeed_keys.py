"""DeepSpeed 0.19.8's own config keys and defaults (issue 40, part 3). The keys DeepSpeed's config reader looks up
were recorded by running it (``tests/fixtures/deepspeed_config/record_keys.py``): each one is implemented or refused
by name here, never dropped with the "unknown key, ignored" warning; the blocks DeepSpeed 0.19 removed are refused
with its reason (or warned about when written disabled); inputs found accepted or unclear are named errors."""

from __future__ import annotations

import json
import logging
import math
import warnings
from pathlib import Path

import pytest
import torch

from zeroshard.config import ConfigError, parse_config
from zeroshard.config.parse import _keys_of
from zeroshard.config.schema import REMOVED_IN_DEEPSPEED, ZeroshardConfig
from zeroshard.precision import PrecisionPolicy

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "deepspeed_config" / "keys_0.19.8.json"
KEYS = json.loads(FIXTURE.read_text())


def _warnings_of(config: dict) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            parse_config(config)
        except (ValueError, NotImplementedError):
            pass  # refused by name: what this test checks is that nothing is dropped as unknown
    return [str(w.message) for w in caught]


@pytest.mark.parametrize("key", KEYS["read"])
def test_no_key_deepspeed_reads_is_dropped_as_unknown(key):
    assert key in _keys_of(ZeroshardConfig), f"'{key}' is read by DeepSpeed 0.19.8 and not in zeroshard's schema"
    assert not [w for w in _warnings_of({"train_batch_size": 2, key: {}}) if "are not DeepSpeed or zeroshard" in w]


def _nested(key: str, value) -> dict:
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


@pytest.mark.parametrize("key", KEYS["section_keys"])
def test_no_key_inside_deepspeeds_sections_is_unknown(key):
    """zenflow, checkpoint.writer, the DeepCompile options, data_types.keep_in_fp32_modules, ...: each honoured,
    satisfied, or refused naming DeepSpeed's meaning; none reported as a misspelling."""
    for value in (True, {}, 1):
        config = {"train_batch_size": 2, **_nested(key, value)}
        if key.startswith("zero_optimization."):
            config["zero_optimization"]["stage"] = 3
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                parse_config(config)
        except (ValueError, TypeError, NotImplementedError) as err:
            assert "unknown config key" not in str(err), str(err)


@pytest.mark.parametrize(
    "key,value,meaning",
    [
        ("zero_optimization.zenflow", {"topk_ratio": 0.1}, "ZenFlow"),
        ("zero_optimization.parameter_alignment", True, "16-byte aligned"),
        ("checkpoint.writer", {"type": "fast"}, "FastPersist"),
        ("bf16.bf16_master_weights_and_grads", True, "fp32 master weights"),
        ("tensor_parallel.kernel_inject", True, "inference kernels"),
        ("compile.autoep_non_moe", True, "AutoEP"),
    ],
)
def test_deepspeed_keys_zeroshard_lacks_are_refused_with_their_meaning(key, value, meaning):
    with pytest.raises(NotImplementedError, match=f"config key '{key}'.*{meaning}"):
        parse_config({"train_batch_size": 2, **_nested(key, value)})


def test_super_offload_and_its_cores_are_honoured():
    """SuperOffload's keys mean zeroshard's exact step during backward (zeroshard/zero/speculation.py)."""
    zero = {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp", "super_offload": True,
                                              "cpuadam_cores_perc": 0.5, "speculation_host_bytes": 2**30}}  # fmt: skip
    opt = parse_config({"train_batch_size": 2, "zero_optimization": zero}).zero_optimization.offload_optimizer
    assert (opt.super_offload, opt.cpuadam_cores_perc, opt.speculation_host_bytes) == (True, 0.5, 2**30)
    default = parse_config({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})
    assert default.zero_optimization.offload_optimizer.super_offload is None  # zeroshard decides: where it helps


@pytest.mark.parametrize(
    "offload,match",
    [
        ({"device": "none", "super_offload": True}, "super_offload: true needs the optimizer offloaded"),
        ({"device": "cpu", "super_offload": "yes"}, "super_offload"),
        ({"device": "cpu", "super_offload": 1.5}, "super_offload"),
        ({"device": "cpu", "cpuadam_cores_perc": 0}, "cpuadam_cores_perc"),
        ({"device": "cpu", "cpuadam_cores_perc": 80}, "cpuadam_cores_perc"),
        ({"device": "cpu", "cpuadam_cores_perc": float("nan")}, "cpuadam_cores_perc"),
        ({"device": "cpu", "cpuadam_cores_perc": "0.8; rm -rf /"}, "cpuadam_cores_perc"),
        ({"device": "cpu", "speculation_host_bytes": -1}, "speculation_host_bytes"),
        ({"device": "cpu", "speculation_host_bytes": 1e400}, "speculation_host_bytes"),
        ({"device": "cpu", "speculation_host_bytes": "1GB"}, "speculation_host_bytes"),
    ],
)
def test_careless_super_offload_values_are_named(offload, match):
    with pytest.raises((ValueError, TypeError), match=match):
        parse_config({"zero_optimization": {"stage": 2, "offload_optimizer": offload}})


def test_layer_major_is_a_stage_3_switch():
    """zeroshard's ``layer_major`` (engine.train_batch unit by unit, Note [layer-major]): off by default, on at stage 3,
    refused below it and for anything but a boolean."""
    assert parse_config({"zero_optimization": {"stage": 3}}).zero_optimization.layer_major is False
    on = parse_config({"zero_optimization": {"stage": 3, "layer_major": True}})
    assert on.zero_optimization.layer_major is True


@pytest.mark.parametrize(
    "zero,match",
    [
        ({"stage": 2, "layer_major": True}, "layer_major .* needs stage 3"),
        ({"stage": 0, "layer_major": True}, "layer_major .* needs stage 3"),
        ({"stage": 3, "layer_major": "yes"}, "layer_major"),
        ({"stage": 3, "layer_major": 2}, "layer_major"),
        ({"stage": 3, "layer_major": float("nan")}, "layer_major"),
        ({"stage": 3, "layer_major": "true; rm -rf /"}, "layer_major"),
        ({"stage": 3, "layer_major": None}, "layer_major"),
    ],
)
def test_careless_layer_major_values_are_named(zero, match):
    with pytest.raises((ValueError, TypeError), match=match):
        parse_config({"zero_optimization": zero})


@pytest.mark.parametrize("key", sorted(REMOVED_IN_DEEPSPEED))
def test_blocks_deepspeed_removed_are_refused_with_the_reason(key):
    assert key in KEYS["removed"]
    with pytest.raises(NotImplementedError, match=f"config key '{key}': DeepSpeed 0.19 removed"):
        parse_config({"train_batch_size": 2, key: {"enabled": True}})
    with pytest.warns(UserWarning, match=f"config key '{key}' \\(disabled\\): DeepSpeed 0.19 removed"):
        parse_config({"train_batch_size": 2, key: {"enabled": False}})


def test_removed_keys_zeroshard_keeps_are_honoured():
    """Elasticity and MiCS left DeepSpeed 0.19; zeroshard keeps both, so their keys still work."""
    assert {"elasticity"} <= set(KEYS["removed"]) and "mics_shard_size" in KEYS["removed_zero"]
    config = parse_config({"elasticity": {"enabled": True, "max_train_batch_size": 8, "micro_batch_sizes": [2]}})
    assert config.elasticity.enabled
    mics = parse_config({"zero_optimization": {"stage": 3, "mics_shard_size": 2}})
    assert mics.zero_optimization.mics_shard_size == 2
    for removed in ("sparse_gradients", "graph_harvesting"):
        with pytest.raises(NotImplementedError, match=f"config key '{removed}' = True.*DeepSpeed 0.19 removed"):
            parse_config({removed: True})


def test_auto_ep_block_parses_and_refuses_what_it_does_not_implement():
    config = parse_config({"expert_parallel": {"enabled": True, "autoep_size": 2, "preset_model": "mixtral"}})
    assert config.expert_parallel.enabled and config.expert_parallel.autoep_size == 2
    assert not parse_config({"expert_parallel": {"autoep_size": 2}}).expert_parallel.enabled  # off unless enabled
    refusals = {
        "preset_model": ("deepseek_v3", "expert_parallel.preset_model"),
        "expert_tensor_parallel_size": (2, "expert_parallel.expert_tensor_parallel_size"),
        "load_balance_coeff": (0.001, "expert_parallel.load_balance_coeff"),
        "router_pattern": ("mlp.gate", "expert_parallel.router_pattern"),
    }
    for key, (value, named) in refusals.items():
        with pytest.raises(NotImplementedError, match=named):
            parse_config({"expert_parallel": {"enabled": True, key: value}})
    for bad in (0, -2, "two", True, 2.5):
        with pytest.raises((ValueError, TypeError), match="autoep_size"):
            parse_config({"expert_parallel": {"enabled": True, "autoep_size": bad}})
    with pytest.raises(NotImplementedError, match="torch_autocast"):
        parse_config({"torch_autocast": {"enabled": True, "dtype": "bfloat16"}})


def test_gradient_clipping_defaults_to_deepspeeds_one():
    assert parse_config({}).gradient_clipping == 1.0
    assert parse_config({"gradient_clipping": 0}).gradient_clipping == 0  # explicit 0 disables
    from zeroshard.config.resolve import AutoContext, resolve_config

    resolution = resolve_config(parse_config({"train_micro_batch_size_per_gpu": 1}), AutoContext(world_size=1))
    (line,) = [d for d in resolution.derived if d[0] == "gradient_clipping"]
    assert line[1] == 1.0 and "default 1.0 as in DeepSpeed" in line[2]


def test_near_typos_of_new_keys_fail_with_did_you_mean():
    with pytest.raises(ConfigError, match="unknown config key 'gradient_clip'; did you mean 'gradient_clipping'"):
        parse_config({"gradient_clip": 1.0})


@pytest.mark.parametrize(
    "config,message",
    [
        ({"bf16": {"enabled": True}, "bfloat16": {"enabled": False}}, "'bf16' and 'bfloat16' are one key"),
        ({"bfloat16": {"enabled": "yes"}}, "'enabled' must be true or false, not the string 'yes'"),
        ({"fp16": {"enabled": "false"}}, "'enabled' must be true or false, not the string 'false'"),
        ({"train_batch_size": 1e20}, "larger than any batch a data loader can draw"),
        ({"train_micro_batch_size_per_gpu": 2**40}, "larger than any batch"),
        ({"csv_monitor": {"enabled": True, "output_path": "/tmp", "job_name": "../x"}}, "must be a plain name"),
        ({"tensorboard": {"enabled": True, "job_name": "a/b"}}, "must be a plain name"),
        ({"csv_monitor": {"job_name": ".."}}, "must be a plain name"),
        ({"gradient_allreduce_op": "SUM"}, None),
        ({"log_level": "loud"}, "log_level"),
    ],
)
def test_inputs_found_accepted_or_unclear_are_named(config, message):
    if message is None:  # refused as not implemented, by name
        with pytest.raises(NotImplementedError, match="config key 'gradient_allreduce_op' = 'sum'"):
            parse_config(config)
        return
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_config(config)


def test_equal_spellings_together_and_auto_switches_are_accepted():
    assert parse_config({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}}).bf16.enabled
    assert parse_config({"bf16": {"enabled": "auto"}}).bf16.enabled == "auto"


def test_a_deeply_nested_config_is_a_named_error(tmp_path):
    nested: dict = {}
    node = nested
    for _ in range(10_000):
        node["a"] = {}
        node = node["a"]
    with pytest.raises(ConfigError, match="nests deeper than 32 levels"):
        parse_config({"optimizer": {"type": "Adam", "params": nested}})
    path = tmp_path / "deep.json"
    path.write_text('{"a":' * 100_000 + "1" + "}" * 100_000)
    with pytest.raises(ConfigError, match="nests deeper than JSON can be read"):
        parse_config(str(path))


def test_keys_deepspeed_0_19_reads_do_what_it_documents():
    """max_reuse_distance 0 (zeroshard's default: keep only the last unit of forward) is accepted; DeepSpeed's
    sequence-parallel reduction dtype replaces communication_data_type under Ulysses (default fp32); log_level sets
    the level of zeroshard's logger (set at initialize, here by the same line of code's effect)."""
    assert parse_config({"zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 0}})
    bf16_sp = parse_config({"bf16": {"enabled": True}, "sequence_parallel_size": 2})
    assert PrecisionPolicy.from_config(bf16_sp).reduce == torch.float32
    fp16_wire = parse_config({"bf16": {"enabled": True}, "sequence_parallel_size": 2,
                              "seq_parallel_communication_data_type": "bf16"})  # fmt: skip
    assert PrecisionPolicy.from_config(fp16_wire).reduce == torch.bfloat16
    assert PrecisionPolicy.from_config(parse_config({"bf16": {"enabled": True}})).reduce == torch.bfloat16
    assert parse_config({"log_level": "WARNING"}).log_level == "warning"
    assert logging.getLevelName("WARNING") == 30
    assert math.isfinite(parse_config({"timers": {"throughput": {"enabled": False}}}).gradient_clipping)


def test_stage3_max_reuse_distance_takes_deepspeeds_values_and_refuses_others_by_name():
    """DeepSpeed's configs write 1e9 (a JSON float) or "auto" (its default, 1e9); zeroshard's default is 0. A negative,
    fractional, NaN, boolean or text distance is a named error."""

    def distance(value):
        return parse_config({"zero_optimization": {"stage": 3, "stage3_max_reuse_distance": value}})

    assert parse_config({"zero_optimization": {"stage": 3}}).zero_optimization.max_reuse_distance == 0
    assert distance(1e9).zero_optimization.max_reuse_distance == 10**9
    assert distance(10**18).zero_optimization.max_reuse_distance == 10**18
    for bad in (-1, 0.5, float("nan"), "far", [1], True):
        with pytest.raises(ConfigError, match="max_reuse_distance"):
            distance(bad)


def test_a_key_and_its_alias_together_keep_the_other_keys_of_the_block():
    zero = parse_config(
        {
            "zero_optimization": {
                "stage": 3,
                "prefetch_bucket_size": 7,
                "stage3_prefetch_bucket_size": 7,
                "stage3_max_live_parameters": 5,
            }
        }  # fmt: skip
    ).zero_optimization
    assert (zero.prefetch_bucket_size, zero.max_live_parameters) == (7, 5)


@pytest.mark.parametrize(
    "key,value",
    [
        ("pipeline.max_activation_bytes", 0),
        ("pipeline.max_activation_bytes", -5),
        ("pipeline.max_activation_bytes", True),
        ("pipeline.max_activation_bytes", float("nan")),
        ("pipeline.max_activation_bytes", "1e9"),
        ("pipeline.schedule", "gpipe"),
        ("pipeline.schedule", "ZB-H1; rm -rf /"),
        ("pipeline.schedule", None),
        ("pipeline.schedule", 1),
        ("aio.verify_reads", "yes"),
        ("aio.verify_reads", None),
        ("data_types.keep_in_fp32_modules", "all"),
        ("data_types.keep_in_fp32_modules", [1, 2]),
        ("data_types.keep_in_fp32_modules", ["a\x00b"]),
        ("data_types.keep_in_fp32_modules", ["x" * 600]),
        ("data_types.keep_in_fp32_modules", ["ok"] * 2000),
        ("data_types.buffer_dtype", "int8"),
        ("data_types.param_dtype", True),
    ],
)
def test_the_keys_this_issue_added_refuse_careless_values_by_name(key, value):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.").split(r"\.")[0]):
        parse_config({"train_batch_size": 2, **_nested(key, value)})


def test_fp32_buffer_patterns_are_names_matched_literally_never_regexes():
    """'*' is the only wildcard: a pattern with shell or regex characters matches only those characters."""
    from zeroshard.precision import NameRule

    config = parse_config({"data_types": {"keep_in_fp32_modules": [";rm -rf /", "$(x)", "-rf", "a.(b"]}})
    assert config.data_types.keep_in_fp32_modules == [";rm -rf /", "$(x)", "-rf", "a.(b"]
    assert NameRule("", "a.(b").matches("x.a.(b.y") and not NameRule("", "a.(b").matches("xa_(b")
    assert NameRule("layers.", "e_score*bias").matches("layers.0.mlp.e_score_correction_bias")
    assert not NameRule("layers.", "e_score*bias").matches("model.e_score_correction_bias")
