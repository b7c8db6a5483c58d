import argparse

import pytest

from zeroshard.config import AutoContext, parse_config, resolve_batch_triad, resolve_config


@pytest.mark.parametrize(
    "given,expected",
    [
        ((32, 4, 2), (32, 4, 2)),
        ((32, 4, None), (32, 4, 2)),
        ((32, None, 2), (32, 4, 2)),
        ((None, 4, 2), (32, 4, 2)),
        ((None, 4, None), (16, 4, 1)),
        ((32, None, None), (32, 8, 1)),
    ],
)
def test_batch_triad_inference(given, expected):
    triad = resolve_batch_triad(*given, world_size=4)
    assert (triad.train_batch_size, triad.micro_batch_size, triad.gradient_accumulation_steps) == expected


def test_batch_triad_errors_name_the_arithmetic():
    with pytest.raises(
        ValueError,
        match=r"train_batch_size 32 != train_micro_batch_size_per_gpu 4 x "
        r"gradient_accumulation_steps 2 x world size 2 = 16",
    ):
        resolve_batch_triad(32, 4, 2, world_size=2)
    with pytest.raises(ValueError, match="not divisible by train_micro_batch_size_per_gpu 3 x world size 2"):
        resolve_batch_triad(8, 3, None, world_size=2)
    with pytest.raises(ValueError, match="needs 'train_batch_size' or 'train_micro_batch_size_per_gpu'"):
        resolve_batch_triad(None, None, 2, world_size=2)


HF_STYLE = {
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
        },
    },
    "zero_optimization": {
        "stage": 2,
        "allgather_partitions": True,
        "allgather_bucket_size": 2e8,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": "auto",
        "contiguous_gradients": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}


def hf_args(**over):
    values = dict(
        learning_rate=5e-5,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        weight_decay=0.0,
        warmup_steps=10,
        max_steps=100,
        max_grad_norm=1.0,
        fp16=False,
        bf16=True,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
    )
    values.update(over)
    return argparse.Namespace(**values)


def test_hf_style_auto_resolves_from_args_and_model_width():
    res = resolve_config(parse_config(HF_STYLE), AutoContext(world_size=2, args=hf_args(), hidden_size=64))
    cfg = res.config
    assert cfg.optimizer.params == {"lr": 5e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
    assert cfg.scheduler.params == {
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 5e-5,
        "warmup_num_steps": 10,
        "total_num_steps": 100,
    }
    assert cfg.zero_optimization.reduce_bucket_size == 64 * 64
    assert cfg.gradient_clipping == 1.0 and cfg.bf16.enabled is True and cfg.fp16.enabled is False
    assert (res.batch.train_batch_size, res.batch.micro_batch_size, res.batch.gradient_accumulation_steps) == (16, 4, 2)
    report = res.report()
    for key in ("optimizer.params.lr", "zero_optimization.reduce_bucket_size", "train_batch_size", "gradient_clipping"):
        assert key in report


def test_unresolvable_auto_names_the_key():
    with pytest.raises(ValueError, match=r"config key 'gradient_clipping' is \"auto\" but nothing resolves it"):
        resolve_config(parse_config(HF_STYLE), AutoContext(world_size=2, args=None, hidden_size=64))
    # DeepSpeed itself resolves a bucket size's "auto" to its default; so does zeroshard when no model width is known
    cfg = parse_config({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"reduce_bucket_size": "auto"}})
    resolution = resolve_config(cfg, AutoContext(world_size=1))
    assert resolution.config.zero_optimization.reduce_bucket_size == 500_000_000
    assert ("zero_optimization.reduce_bucket_size", 500_000_000, "DeepSpeed's default for auto") in resolution.derived


def test_batch_from_dataloader_when_auto():
    cfg = parse_config({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 3})
    res = resolve_config(cfg, AutoContext(world_size=2, dataloader_batch_size=5))
    assert (res.batch.train_batch_size, res.batch.micro_batch_size) == (30, 5)


def test_overlap_comm_dynamic_default_is_recorded():
    res = resolve_config(parse_config({"train_batch_size": 4}), AutoContext(world_size=1))
    assert res.config.zero_optimization.overlap_comm is False
    assert any(k == "zero_optimization.overlap_comm" for k, _, _ in res.derived)


def test_sequence_parallel_batch_counts_data_parallel_ranks_and_corrects_a_count_of_every_rank():
    """DeepSpeed: train_batch_size = micro x accumulation x world / sequence_parallel_size. A value that counted every
    rank (the HF Trainer writes world x micro x accumulation) is corrected with a warning naming both."""
    cfg = parse_config({"train_micro_batch_size_per_gpu": 2, "sequence_parallel_size": 4})
    assert cfg.sequence_parallel_size == 4
    res = resolve_config(cfg, AutoContext(world_size=2, sequence_parallel_size=4))
    assert res.batch.train_batch_size == 4
    hf = parse_config({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1})
    with pytest.warns(UserWarning, match="train_batch_size 16 -> 4: 16 counted all 8 ranks; the 4 ranks of a sequence"):
        res = resolve_config(hf, AutoContext(world_size=2, sequence_parallel_size=4))
    assert res.batch.train_batch_size == 4
    for bad in (0, -1, "two"):
        with pytest.raises(ValueError, match="sequence_parallel_size"):
            parse_config({"train_batch_size": 2, "sequence_parallel_size": bad})
