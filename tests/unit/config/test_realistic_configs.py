"""Configs as users bring them (HF Trainer, Lightning, DeepSpeed tutorials) parse or fail as documented."""

import json
from pathlib import Path

import pytest

from zeroshard.config import parse_config

LIGHTNING_STAGE2 = {
    "zero_allow_untested_optimizer": True,
    "zero_optimization": {
        "stage": 2,
        "contiguous_gradients": True,
        "overlap_comm": True,
        "allgather_partitions": True,
        "reduce_scatter": True,
        "allgather_bucket_size": 200000000,
        "reduce_bucket_size": 200000000,
        "sub_group_size": 1000000000000,
    },
    "activation_checkpointing": {
        "partition_activations": False,
        "cpu_checkpointing": False,
        "contiguous_memory_optimization": False,
        "synchronize_checkpoint_boundary": False,
    },
    "aio": {"block_size": 1048576, "queue_depth": 8, "single_submit": False, "overlap_events": True, "thread_count": 1},
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "fp16": {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": 32,
        "loss_scale_window": 1000,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
}

HF_STAGE3_OFFLOAD = {
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
    },
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}

TUTORIAL_STAGE1 = {
    "train_batch_size": 16,
    "steps_per_print": 2000,
    "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000}},
    "gradient_clipping": 1.0,
    "prescale_gradients": False,
    "fp16": {
        "enabled": True,
        "fp16_master_weights_and_grads": False,
        "loss_scale": 0,
        "loss_scale_window": 500,
        "hysteresis": 2,
        "min_loss_scale": 1,
        "initial_scale_power": 15,
    },
    "wall_clock_breakdown": False,
    "zero_optimization": {
        "stage": 1,
        "allgather_partitions": True,
        "reduce_scatter": True,
        "allgather_bucket_size": 50000000,
        "reduce_bucket_size": 50000000,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "cpu_offload": False,
    },
    "comms_logger": {"enabled": True, "verbose": False, "prof_all": True, "debug": False},
    "tensorboard": {"enabled": False, "output_path": "logs/", "job_name": "train"},
    "csv_monitor": {"enabled": True, "output_path": "logs/", "job_name": "train"},
}

NVME_STAGE3 = {
    "train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {
            "device": "nvme",
            "nvme_path": "/local_nvme",
            "pin_memory": True,
            "buffer_count": 4,
            "fast_init": False,
        },
        "offload_param": {
            "device": "nvme",
            "nvme_path": "/local_nvme",
            "pin_memory": True,
            "buffer_count": 5,
            "buffer_size": 1e8,
            "max_in_cpu": 1e9,
        },
    },
    "aio": {"block_size": 262144, "queue_depth": 32, "thread_count": 1, "single_submit": False, "overlap_events": True},
}


@pytest.mark.parametrize(
    "cfg",
    [LIGHTNING_STAGE2, HF_STAGE3_OFFLOAD, TUTORIAL_STAGE1, NVME_STAGE3],
    ids=["lightning-stage2", "hf-stage3-offload", "tutorial-stage1", "nvme-stage3"],
)
def test_realistic_configs_parse(cfg):
    parsed = parse_config(cfg)
    assert parsed.zero_optimization.stage == cfg["zero_optimization"]["stage"]


def test_hf_stage3_keeps_auto_until_resolution():
    z = parse_config(HF_STAGE3_OFFLOAD).zero_optimization
    assert z.prefetch_bucket_size == "auto" and z.param_persistence_threshold == "auto"
    assert z.offload_param.pin_memory is True and z.gather_16bit_weights_on_model_save is True


def test_typo_in_realistic_config_is_named():
    cfg = {**TUTORIAL_STAGE1, "zero_optimization": {**TUTORIAL_STAGE1["zero_optimization"], "overlap_com": True}}
    with pytest.raises(
        ValueError, match="unknown config key 'zero_optimization.overlap_com'; did you mean 'overlap_comm'"
    ):
        parse_config(cfg)


EXAMPLES = sorted((Path(__file__).resolve().parents[3] / "examples" / "configs").glob("*.json"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_shipped_example_configs_parse(path):
    parse_config(json.loads(path.read_text()))


def test_offload_keys_are_checked():
    twin_flow = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}}
    assert parse_config(twin_flow).zero_optimization.offload_optimizer.ratio == 0.3  # honoured: partial offload
    with pytest.raises(ValueError, match="'zero_optimization.offload_optimizer.ratio' = 1.3"):
        parse_config({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 1.3}}})
    with pytest.raises(NotImplementedError, match="use_gds"):
        parse_config({"aio": {"use_gds": True}})
    with pytest.raises(ValueError, match="set stage to 1, 2 or 3"):
        parse_config({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}})
    cfg = parse_config({"aio": {"thread_count": 4}})  # the old name
    assert cfg.aio.intra_op_parallelism == 4
