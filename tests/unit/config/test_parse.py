import json
import warnings

import pytest

from zeroshard.config import parse_config


def error_of(cfg) -> str:
    with pytest.raises(ValueError) as info:
        parse_config(cfg)
    return str(info.value)


def test_defaults_match_deepspeed():
    cfg = parse_config({})
    assert cfg.zero_optimization.stage == 0
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000
    assert cfg.zero_optimization.prefetch_bucket_size == 50_000_000
    assert cfg.gradient_clipping == 1.0  # DeepSpeed 0.19 (its PR #8068); 0 disables
    assert cfg.steps_per_print == 10
    assert cfg.fp16.initial_scale_power == 16 and cfg.fp16.loss_scale_window == 1000


def test_unknown_keys_are_named_with_a_suggestion():
    assert "unknown config key 'train_batch_sise'; did you mean 'train_batch_size'?" in error_of(
        {"train_batch_sise": 4}
    )
    assert "unknown config key 'zero_optimization.stag'; did you mean 'stage'?" in error_of(
        {"zero_optimization": {"stag": 2}}
    )
    assert "unknown config key 'zero_optimization.offload_optimizer.nvm_path'" in error_of(
        {"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvm_path": "/x"}}}
    )
    assert "unknown config key 'zero_optimization.bogus'; remove it or check its spelling" in error_of(
        {"zero_optimization": {"bogus": 1}}
    )
    # a top-level key DeepSpeed does not know is ignored with a warning (tests/unit/config/test_client_configs.py)
    with pytest.warns(UserWarning, match=r"\['bogus'\] are not DeepSpeed or zeroshard keys"):
        parse_config({"train_batch_size": 2, "bogus": 1})


def test_wrong_types_and_ranges_name_key_and_value():
    msg = error_of({"zero_optimization": {"stage": 5}})
    assert "config key 'zero_optimization.stage' = 5" in msg and "less than or equal to 3" in msg
    msg = error_of({"train_batch_size": "big"})
    assert "config key 'train_batch_size' = 'big'" in msg and "valid integer" in msg and "'auto'" in msg
    assert "config key 'gradient_clipping' = -1: must be >= 0" in error_of({"gradient_clipping": -1})
    assert "config key 'train_micro_batch_size_per_gpu' = 0: must be a positive integer" in error_of(
        {"train_micro_batch_size_per_gpu": 0}
    )
    assert "config key 'fp16.loss_scale_window' = 0" in error_of({"fp16": {"loss_scale_window": 0}})
    assert "config key 'zero_optimization.reduce_bucket_size' = -5: must be >= 0" in error_of(
        {"zero_optimization": {"reduce_bucket_size": -5}}
    )


def test_inconsistent_values():
    assert "fp16.enabled and bf16.enabled are both true" in error_of(
        {"fp16": {"enabled": True}, "bf16": {"enabled": True}}
    )
    assert "device 'nvme' needs 'nvme_path'" in error_of(
        {"zero_optimization": {"offload_optimizer": {"device": "nvme"}}}
    )
    for section, count in (("offload_optimizer", 10**9), ("offload_param", 10**7)):  # allocated up front: OOM
        assert "buffer_count' = " in error_of(
            {"zero_optimization": {"stage": 3, section: {"device": "nvme", "nvme_path": "/x", "buffer_count": count}}}
        )
    for section in ("offload_optimizer", "offload_param"):  # "" was Path("."): swap files in the working directory
        for empty in ("", "  "):
            assert "nvme_path is empty" in error_of(
                {"zero_optimization": {"stage": 3, section: {"device": "nvme", "nvme_path": empty}}}
            )
    assert "either zero_hpz_partition_size or mics_shard_size" in error_of(
        {"zero_optimization": {"zero_hpz_partition_size": 2, "mics_shard_size": 2}}
    )
    for key in ("zero_quantized_weights", "zero_quantized_gradients", "zero_quantized_nontrainable_weights"):
        assert f"{key} quantizes stage 3's" in error_of({"zero_optimization": {"stage": 2, key: True}})
    assert "zero_quantized_nontrainable_weights keeps frozen parameters as int8" in error_of(
        {
            "zero_optimization": {
                "stage": 3,
                "zero_quantized_nontrainable_weights": True,
                "offload_param": {"device": "cpu"},
            }
        }
    )


def test_stage3_aliases_and_field_names_both_work():
    a = parse_config({"zero_optimization": {"stage3_prefetch_bucket_size": 123, "stage3_max_live_parameters": 7}})
    b = parse_config({"zero_optimization": {"prefetch_bucket_size": 123, "max_live_parameters": 7}})
    assert a.zero_optimization == b.zero_optimization
    assert a.zero_optimization.prefetch_bucket_size == 123


def test_deprecated_spellings_map_to_new_keys():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = parse_config(
            {
                "zero_optimization": {
                    "stage": 3,
                    "stage3_gather_fp16_weights_on_model_save": True,
                    "cpu_offload": True,
                    "cpu_offload_param": True,
                    "cpu_offload_use_pin_memory": True,
                }
            }
        )
    z = cfg.zero_optimization
    assert z.gather_16bit_weights_on_model_save is True
    assert z.offload_optimizer.device.value == "cpu" and z.offload_optimizer.pin_memory is True
    assert z.offload_param.device.value == "cpu"
    assert any("deprecated" in str(w.message) for w in caught)
    assert parse_config({"aio": {"thread_count": 3}}).aio.intra_op_parallelism == 3
    assert parse_config({"zero_optimization": True}).zero_optimization.stage == 1
    assert parse_config({"bfloat16": {"enabled": True}}).bf16.enabled is True


def test_conflicting_deprecated_and_new_key():
    msg = error_of(
        {
            "zero_optimization": {
                "stage3_gather_fp16_weights_on_model_save": True,
                "stage3_gather_16bit_weights_on_model_save": False,
            }
        }
    )
    assert "disagree" in msg


def test_enabled_unsupported_feature_block_is_refused_disabled_one_accepted():
    with pytest.raises(NotImplementedError, match="'hybrid_engine'"):
        parse_config({"hybrid_engine": {"max_out_tokens": 2}})
    parse_config({"autotuning": {"enabled": False}})


def test_flops_profiler_block_is_typed():
    block = parse_config(
        {"flops_profiler": {"enabled": True, "profile_step": 3, "output_file": "p.txt"}}
    ).flops_profiler
    assert (block.enabled, block.profile_step, block.module_depth, block.top_modules, block.detailed) == (
        True,
        3,
        -1,
        1,
        True,
    )
    for bad in ({"profile_step": 0}, {"profile_steps": 2}, {"recompute_fwd_factor": float("nan")}, {"top_modules": 0}):
        with pytest.raises(ValueError, match="flops_profiler"):
            parse_config({"flops_profiler": {"enabled": True, **bad}})


def test_json_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8}))
    assert parse_config(str(path)).train_batch_size == 8
    with pytest.raises(ValueError, match="does not exist"):
        parse_config(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_config(bad)


@pytest.mark.parametrize("depth", [-1, 10**7, "two", float("nan"), 1.5, None])
def test_stage3_prefetch_depth_refuses_what_is_not_a_unit_count(depth):
    with pytest.raises(ValueError, match="prefetch_depth"):
        parse_config({"train_batch_size": 2, "zero_optimization": {"stage": 3, "stage3_prefetch_depth": depth}})


def test_stage3_prefetch_depth_defaults_to_one_unit_and_takes_zero():
    assert parse_config({"train_batch_size": 2}).zero_optimization.prefetch_depth == 1
    zero = {"stage": 3, "stage3_prefetch_depth": 0}
    assert parse_config({"train_batch_size": 2, "zero_optimization": zero}).zero_optimization.prefetch_depth == 0


def test_an_integer_of_thousands_of_digits_names_the_file_and_key(tmp_path):
    """Python refuses to read integers of over 4300 digits with a ValueError naming neither: the file and the key."""
    from zeroshard.config import parse_config

    path = tmp_path / "ds.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": ' + "9" * 5000 + "}}")
    with pytest.raises(ValueError, match=r"ds.json': key 'zero_optimization.stage' holds an integer of 5000 digits"):
        parse_config(str(path))
    with pytest.raises(ValueError, match=r"'train_batch_size' = <an integer of about 5001 digits>"):
        parse_config({"train_batch_size": 10**5000})  # the same number given as a dict: its repr is never written
