"""The config shapes today's fine-tuning stacks write (OpenRLHF, ArcticTraining, axolotl, LLaMA-Factory,
Accelerate) parse, and each value they leave to DeepSpeed resolves the way DeepSpeed (or HF) resolves it."""

import math
import warnings

import pytest

from zeroshard.config import AutoContext, ConfigError, parse_config, resolve_config

# openrlhf.utils.deepspeed.deepspeed_utils.get_train_ds_config (stage 3, bf16, no offload)
OPENRLHF = {
    "steps_per_print": 100,
    "zero_optimization": {
        "stage": 3,
        "offload_param": {"device": "none"},
        "offload_optimizer": {"device": "none", "pin_memory": True},
        "sub_group_size": "auto",
        "stage3_max_live_parameters": "auto",
        "stage3_max_reuse_distance": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "reduce_bucket_size": "auto",
        "zero_hpz_partition_size": 1,
        "zero_quantized_weights": False,
        "zero_quantized_gradients": False,
    },
    "bf16": {"enabled": True},
    "gradient_clipping": 1.0,
    "prescale_gradients": False,
    "wall_clock_breakdown": False,
    "data_types": {"grad_accum_dtype": "fp32"},
    "tensor_parallel": {"autotp_size": 0},
    "compile": {"deepcompile": False},
    "train_micro_batch_size_per_gpu": 1,
    "train_batch_size": 8,
}
# ArcticTraining: a float global batch, the bfloat16 alias, sequence_parallel_size always written
ARCTIC = {
    "train_batch_size": 8.0,
    "train_micro_batch_size_per_gpu": 2,
    "bfloat16": {"enabled": True},
    "sequence_parallel_size": 1,
    "zero_optimization": {"stage": 2},
}
# axolotl deepspeed_configs/zero1_torch_compile.json
AXOLOTL_COMPILE = {
    "zero_optimization": {"stage": 1, "overlap_comm": True},
    "compile": {"disable": False, "backend": "inductor"},
    "bf16": {"enabled": "auto"},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}
# LLaMA-Factory examples/deepspeed: top-level keys DeepSpeed does not know
LLAMA_FACTORY = {
    "train_micro_batch_size_per_gpu": 2,
    "zero_optimization": {"stage": 2},
    "comms_config": {"verbose": False},
    "monitor_config": {"enabled": False},
}
# Accelerate's DeepSpeed plugin with mixed_precision="fp16" and offload_param_device at stage 2
ACCELERATE_FP16 = {
    "train_micro_batch_size_per_gpu": 2,
    "fp16": {"enabled": True, "auto_cast": True},
    "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}},
}


def test_openrlhf_autos_resolve_to_deepspeed_defaults_and_are_printed():
    config = parse_config(OPENRLHF)
    assert config.tensor_parallel.autotp_size == 1 and config.compile.deepcompile is False
    resolution = resolve_config(config, AutoContext(world_size=2))
    zero = resolution.config.zero_optimization
    assert (zero.sub_group_size, zero.max_live_parameters, zero.max_reuse_distance) == (10**9, 10**9, 10**9)
    assert (zero.prefetch_bucket_size, zero.param_persistence_threshold, zero.reduce_bucket_size) == (
        50_000_000,
        100_000,
        500_000_000,
    )
    report = resolution.report()
    assert "zero_optimization.sub_group_size" in report and "DeepSpeed's default for auto" in report
    # with a model width, HF's formulas (as HF fills them for the Trainer)
    wide = resolve_config(config, AutoContext(world_size=2, hidden_size=64)).config.zero_optimization
    assert (wide.reduce_bucket_size, wide.prefetch_bucket_size, wide.param_persistence_threshold) == (4096, 3686, 640)


def test_arctic_training_float_batch_and_aliases():
    config = parse_config(ARCTIC)
    assert config.train_batch_size == 8 and isinstance(config.train_batch_size, int)
    assert config.bf16.enabled is True and config.sequence_parallel_size == 1
    for value in (8.5, math.nan, math.inf, True):
        with pytest.raises(ConfigError, match="train_batch_size"):
            parse_config({**ARCTIC, "train_batch_size": value})


def test_axolotl_compile_block_is_kept_for_engine_compile():
    config = parse_config(AXOLOTL_COMPILE)
    assert config.compile.disable is False and config.compile.backend == "inductor"


@pytest.mark.parametrize(
    "block,key",
    [
        ({"tensor_parallel": {"autotp_size": 2, "tp": {"tp_grain_size": 64}}}, "tensor_parallel.tp.tp_grain_size"),
        ({"tensor_parallel": {"autotp_size": 2, "preset_model": "bloom"}}, "tensor_parallel.preset_model"),
        (
            {"tensor_parallel": {"partition_config": {"layer_specs": [{"patterns": ["x"], "gather_output": True}]}}},
            r"tensor_parallel.partition_config.layer_specs\[0\].gather_output",
        ),
        ({"compile": {"autoep_non_moe": True}}, "compile.autoep_non_moe"),
    ],
)
def test_what_is_really_not_implemented_is_refused_by_name(block, key):
    with pytest.raises(NotImplementedError, match=f"config key '{key}'"):
        parse_config({"train_batch_size": 2, **block})


def test_unknown_top_level_keys_warn_once_and_typos_still_fail():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = parse_config(LLAMA_FACTORY)
    messages = [str(w.message) for w in caught if "not DeepSpeed or zeroshard keys" in str(w.message)]
    assert len(messages) == 1 and "'comms_config'" in messages[0] and "'monitor_config'" in messages[0]
    assert config.train_micro_batch_size_per_gpu == 2
    for typo, known in (("train_batch_sise", "train_batch_size"), ("fp61", "fp16"), ("zero_optimisation", "")):
        with pytest.raises(ConfigError, match=f"unknown config key '{typo}'") as info:
            parse_config({"train_batch_size": 2, typo: 1})
        assert f"did you mean '{known}'" in str(info.value) or not known
    with pytest.raises(ConfigError, match="did you mean 'stage'"):  # sections stay strict, as DeepSpeed's
        parse_config({"train_batch_size": 2, "zero_optimization": {"stag": 1}})
    # hostile keys: long, shell metacharacters, not strings: named and dropped, never evaluated
    odd = {"x" * 10_000: 1, "$(rm -rf /); `id`": 2, 7: 3}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parse_config({"train_batch_size": 2, **odd})
    assert any("$(rm -rf /)" in str(w.message) for w in caught)


def test_accelerate_fp16_auto_cast_and_offload_param_below_stage_3():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = parse_config(ACCELERATE_FP16)
    said = [str(w.message) for w in caught if "offload_param" in str(w.message)]
    assert len(said) == 1 and "no effect at stage 2" in said[0]
    assert config.zero_optimization.offload_param is None  # ignored, as DeepSpeed ignores it below stage 3
    assert config.fp16.auto_cast is True
    staged = parse_config({**ACCELERATE_FP16, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}})
    assert staged.zero_optimization.offload_param.device.value == "cpu"
