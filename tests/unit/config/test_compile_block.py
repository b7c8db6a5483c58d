"""The ``compile`` block as OpenRLHF (``--ds.deepcompile``) and axolotl (``deepcompile: true``) write it: accepted,
DeepCompile's ZeRO passes checked against the stage, its tuning knobs named in one warning saying why they change
nothing, and what zeroshard cannot serve refused by name."""

import math
import warnings

import pytest

from zeroshard.config import ConfigError, parse_config
from zeroshard.config.schema import CompileConfig

from .test_client_configs import OPENRLHF

# DeepSpeed 0.19.8's deepspeed/compile/config.py defaults, each flipped
EVERY_KNOB = {
    "free_activation": True,
    "free_activation_threshold": 1024,
    "offload_activation": True,
    "offload_activation_pin_memory": False,
    "offload_opt_states": True,
    "offload_parameters": True,
    "double_buffer": False,
    "symmetric_memory": True,
    "debug_log": True,
    "sync_before_reduce": True,
    "sync_after_reduce": True,
    "sync_before_allgather": True,
    "sync_after_allgather": True,
    "keep_int_input_tensors": False,
    "keep_all_input_tensors": True,
}


def _parse(config: dict) -> tuple:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parsed = parse_config(config)
    return parsed, [str(w.message) for w in caught if "not acted on" in str(w.message)]


@pytest.mark.parametrize("stage", [2, 3])  # OpenRLHF's default stage is 2; its README's examples use 3
def test_openrlhf_deepcompile_config_parses_without_a_warning(stage):
    config = {**OPENRLHF, "zero_optimization": {**OPENRLHF["zero_optimization"], "stage": stage}}
    parsed, warned = _parse({**config, "compile": {"deepcompile": True}})
    assert parsed.compile.deepcompile is True and warned == []


def test_axolotl_deepcompile_block_parses():
    # axolotl's check_deepcompile adds exactly this block to the user's DeepSpeed JSON
    parsed, warned = _parse(
        {"train_batch_size": 2, "zero_optimization": {"stage": 3}, "compile": {"deepcompile": True}}
    )
    assert parsed.compile.deepcompile and warned == []


def test_every_knob_not_acted_on_is_named_once_with_why():
    _, warned = _parse({"train_batch_size": 2, "compile": {"deepcompile": True, **EVERY_KNOB}})
    assert len(warned) == 1
    for key in EVERY_KNOB:
        assert f"'compile.{key}'" in warned[0]
    assert "activation checkpointing" in warned[0] and "stage3_prefetch_bucket_size" in warned[0]


def test_knobs_at_deepspeeds_defaults_are_silent():
    defaults = {key: CompileConfig.model_fields[key].default for key in EVERY_KNOB}
    _, warned = _parse({"train_batch_size": 2, "compile": {"deepcompile": True, **defaults}})
    assert warned == []


@pytest.mark.parametrize("stage,passes", [(3, ["z3"]), (1, ["z1"]), (2, ["z1"])])
def test_a_zero_pass_for_the_configured_stage_is_accepted(stage, passes):
    parsed, _ = _parse({"train_batch_size": 2, "zero_optimization": {"stage": stage}, "compile": {"passes": passes}})
    assert parsed.compile.passes == passes


@pytest.mark.parametrize("stage,passes", [(1, ["z3"]), (3, ["z1"]), (0, ["z1"]), (0, ["z3"])])
def test_a_zero_pass_for_another_stage_is_refused_naming_both(stage, passes):
    with pytest.raises(ConfigError, match=rf"compile.passes \['{passes[0]}'\].*zero_optimization.stage is {stage}"):
        parse_config({"train_batch_size": 2, "zero_optimization": {"stage": stage}, "compile": {"passes": passes}})


@pytest.mark.parametrize("name,instead", [("autosp", "sequence_parallel_size"), ("autotp", "tensor_parallel")])
def test_parallelizing_passes_are_refused_with_the_zeroshard_key(name, instead):
    with pytest.raises(NotImplementedError, match=f"'{name}' pass.*{instead}"):
        parse_config({"train_batch_size": 2, "compile": {"deepcompile": True, "passes": [name]}})


@pytest.mark.parametrize(
    "block,key",
    [
        ({"deepcompile": "yes"}, "deepcompile"),
        ({"deepcompile": 1.5}, "deepcompile"),
        ({"free_activation_threshold": True}, "free_activation_threshold"),
        ({"free_activation_threshold": math.nan}, "free_activation_threshold"),
        ({"passes": ["z3; rm -rf /"]}, "passes"),
        ({"passes": "z3"}, "passes"),
        ({"kwargs": ["fullgraph"]}, "kwargs"),
        ({"backend": 7}, "backend"),
        ({"deepcompil": True}, "deepcompil"),
    ],
)
def test_hostile_compile_values_are_named(block, key):
    with pytest.raises(ConfigError, match=key):
        parse_config({"train_batch_size": 2, "compile": block})
