"""``zeroshard.estimate`` and ``zeroshard estimate``: the plan on a meta model (no memory), model-state bytes
that follow ZeRO's arithmetic, activations that follow the micro-batch and checkpointing, the CLI's breakdown
and recommendation, and DeepSpeed's model-state estimators against DeepSpeed's published table."""

import json
import math
import os
import re

import pytest
import torch

import zeroshard
from zeroshard.estimator import Candidate, main, parse_bytes
from zeroshard.testing.models import GPT, GPTConfig, recompute_blocks

CFG = GPTConfig(vocab_size=256, block_size=32, n_layer=3, n_head=2, n_embd=64)
MiB = 2**20


def tiny_gpt(recompute: bool = False, cfg: GPTConfig = CFG) -> GPT:
    model = GPT(cfg)
    return recompute_blocks(model) if recompute else model


def tiny_inputs(micro_batch: int, seq_len: int):
    ids = torch.zeros(micro_batch, seq_len, dtype=torch.long, device="meta")
    return (ids, ids)


def config(stage: int, micro: int = 2, **zero) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, **zero},
    }


def test_parse_bytes():
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("1.5 MiB") == 3 * 2**19
    assert parse_bytes("123") == 123
    with pytest.raises(ValueError, match="cannot read '80 parsecs'"):
        parse_bytes("80 parsecs")


def test_the_model_is_planned_on_meta():
    built = []

    def factory():
        built.append(tiny_gpt())
        return built[-1]

    zeroshard.estimate(factory, config(3), world_size=2, sample_inputs=tiny_inputs(2, 32), runtime_bytes=0)
    assert all(p.is_meta for p in built[0].parameters())
    real = tiny_gpt()
    zeroshard.estimate(real, config(0), world_size=2, runtime_bytes=0)
    assert not any(p.is_meta for p in real.parameters())  # a module passed in is copied, not modified


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_model_state_follows_zero_arithmetic(stage):
    world = 4
    p = tiny_gpt().num_params()
    zero = {"reduce_bucket_size": 10**9, "stage3_param_persistence_threshold": 0}  # every parameter sharded
    est = zeroshard.estimate(tiny_gpt, config(stage, **zero), world, runtime_bytes=0)
    b = {c: sum(est.bytes[c].values()) for c in est.bytes}
    # fp32 Adam: parameters 4, gradients 4, exp_avg + exp_avg_sq 8 bytes per parameter, the last three sharded
    # from stage 1 on (one bucket, padded to a multiple of the world size; the gathered units keep their own)
    shard = math.ceil(p / world) if stage else p
    assert b["optimizer_state"] == pytest.approx(8 * shard, rel=0.01)
    assert b["gradients"] == pytest.approx(4 * shard, rel=0.01)
    assert b["parameters"] == pytest.approx(4 * (shard if stage == 3 else p), rel=0.01)
    assert (b["gathered_units"] > 0) == (stage == 3)
    assert "no sample_inputs" in est.notes[0]


def test_offload_moves_optimizer_state_to_host():
    est = zeroshard.estimate(tiny_gpt, config(2, offload_optimizer={"device": "cpu"}), 2, runtime_bytes=0)
    assert est.bytes["optimizer_state"]["device"] == 0
    assert est.bytes["optimizer_state"]["host"] > 0 and est.bytes["gradients"]["host"] > 0
    # fp32 compute with an offloaded optimizer keeps its own fp32 master copy on the host: 12 bytes/param
    assert est.bytes["optimizer_state"]["host"] == pytest.approx(12 * tiny_gpt().num_params() / 2, rel=0.01)


def test_activations_follow_micro_batch_and_checkpointing():
    def activations(micro, recompute=False):
        est = zeroshard.estimate(
            lambda: tiny_gpt(recompute), config(0, micro), 1, tiny_inputs(micro, 32), runtime_bytes=0
        )
        return est.bytes["activations"]["device"]

    # linear in the micro-batch (plus the largest parameter's gradient, which does not grow with it)
    assert activations(8) - activations(4) == pytest.approx(2 * (activations(4) - activations(2)), rel=0.01)
    # checkpointing keeps each block's input and recomputes one block at a time: on a deep model whose blocks
    # hold most activations, the saving approaches the number of blocks
    deep = GPTConfig(vocab_size=64, block_size=32, n_layer=12, n_head=2, n_embd=64)

    def blocks_activations(recompute):
        est = zeroshard.estimate(
            lambda: tiny_gpt(recompute, deep), config(0, 4), 1, tiny_inputs(4, 32), runtime_bytes=0
        )
        return est.bytes["activations"]["device"]

    assert blocks_activations(True) < 0.25 * blocks_activations(False)


def test_layer_major_keeps_every_micro_batch_of_the_step():
    """``layer_major`` runs the forward of all ``gradient_accumulation_steps`` micro-batches before backward: their
    saved activations add up (what one micro-batch keeps, times their number), and the estimate says so; checkpointing
    keeps that to each block's input per micro-batch."""

    def activations(gas, layer_major, recompute=False):
        cfg = {**config(3, 4, layer_major=layer_major), "gradient_accumulation_steps": gas}
        est = zeroshard.estimate(lambda: tiny_gpt(recompute), cfg, 2, tiny_inputs(4, 32), runtime_bytes=0)
        return est.bytes["activations"]["device"], est.notes

    one, _ = activations(1, True)
    loop, _ = activations(8, False)
    major, notes = activations(8, True)
    assert loop == one  # the micro-batch loop holds one micro-batch's at a time
    two, _ = activations(2, True)
    assert two > one and major - one == 7 * (two - one)  # one micro-batch's saved activations more per micro-batch
    assert any("layer_major: the activations of the step's 8 micro-batches" in note for note in notes)
    checkpointed, _ = activations(8, True, recompute=True)
    assert checkpointed < 0.6 * major


def test_bf16_halves_parameters_and_activations():
    fp32 = zeroshard.estimate(tiny_gpt, config(3), 2, tiny_inputs(2, 32), runtime_bytes=0)
    bf16 = zeroshard.estimate(
        tiny_gpt, {**config(3), "bf16": {"enabled": True}}, 2, tiny_inputs(2, 32), runtime_bytes=0
    )
    assert bf16.bytes["parameters"]["device"] == fp32.bytes["parameters"]["device"] // 2
    assert bf16.bytes["gathered_units"]["device"] == fp32.bytes["gathered_units"]["device"] // 2
    assert bf16.bytes["activations"]["device"] < 0.7 * fp32.bytes["activations"]["device"]


def test_runtime_is_probed_once_and_counted():
    est = zeroshard.estimate(tiny_gpt, config(0), 1)
    runtime = est.bytes["runtime"]["device"]
    assert 50 * MiB < runtime < 2048 * MiB  # torch, zeroshard, a Gloo group and one training step
    assert est.peak == est.total("device") + est.total("host")
    assert "predicted peak process RSS" in est.table()


def test_factory_must_return_a_module():
    with pytest.raises(TypeError, match="not an nn.Module"):
        zeroshard.estimate(lambda: "gpt", config(0), 1)


def test_tensor_parallel_configs_are_refused_by_name():
    with pytest.raises(NotImplementedError, match="tensor_parallel.autotp_size > 1"):
        zeroshard.estimate(tiny_gpt, {**config(1), "tensor_parallel": {"autotp_size": 2}}, 2, runtime_bytes=0)


def test_candidate_config_and_traffic():
    base = {"train_batch_size": 64, "zero_optimization": {"stage": 1, "offload_param": {"device": "cpu"}}}
    out = Candidate(stage=3, offload="cpu", micro_batch=2, recompute=True).apply(base)
    assert out["train_micro_batch_size_per_gpu"] == 2 and "train_batch_size" not in out
    assert out["zero_optimization"] == {
        "stage": 3,
        "offload_optimizer": {"device": "cpu"},
        "offload_param": {"device": "cpu"},
    }
    # stage 3 moves 1.5x the bytes of stage 2; offload adds host copies; bigger micro-batches amortize both
    traffic = lambda stage, offload="none", micro=1: Candidate(stage, offload, micro, False).traffic_per_sample(  # noqa: E731
        10**6, 8, 2
    )
    assert traffic(3) == pytest.approx(1.5 * traffic(2))
    assert traffic(2, "cpu") > traffic(2) and traffic(2, micro=4) == traffic(2) / 4


def test_cli_prints_breakdown_and_recommends(tmp_path, capsys):
    path = tmp_path / "ds.json"
    ds = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 0, "reduce_bucket_size": 20_000}}
    path.write_text(json.dumps(ds))
    factory = "tests.unit.test_estimator:tiny_gpt"
    args = ["--config", str(path), "--num_gpus", "2", "--factory", factory, "--seq_len", "32"]
    assert main(args + ["--sample_inputs", "tests.unit.test_estimator:tiny_inputs"]) == 0
    out = capsys.readouterr().out
    assert "ZeRO stage 0, 2 rank(s), micro-batch 4" in out and "activations" in out
    assert re.search(r"predicted peak process RSS \(CPU run\): [\d.]+ MiB", out)

    # a budget between the stage-2 and stage-0 peaks: a sharded stage fits, the least traffic first
    def peak(stage):
        staged = {**ds, "zero_optimization": {**ds["zero_optimization"], "stage": stage}}
        return zeroshard.estimate(tiny_gpt, staged, 2, tiny_inputs(4, 32)).peak

    assert peak(2) < peak(0)
    budget = str((peak(0) + peak(2)) // 2)
    assert main(args + ["--sample_inputs", "tests.unit.test_estimator:tiny_inputs", "--budget", budget]) == 0
    out = capsys.readouterr().out
    recommended = re.search(r"recommended: stage (\d), offload (\w+), micro-batch (\d+)", out)
    assert recommended and int(recommended.group(1)) in (1, 2)
    # nothing fits in 1 MiB: an error exit and what to do
    assert main(args + ["--sample_inputs", "tests.unit.test_estimator:tiny_inputs", "--budget", "1MiB"]) == 1
    assert "nothing fits" in capsys.readouterr().out


def test_cli_with_a_hugging_face_config(tmp_path, capsys):
    """A GPT-2 config: its forward runs data-dependent mask checks, read on meta data as unpadded inputs."""
    from transformers import GPT2Config

    GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=500, n_positions=128).save_pretrained(tmp_path)
    path = tmp_path / "ds.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 8, "bf16": {"enabled": true}}')
    args = ["--config", str(path), "--num_gpus", "4", "--num_nodes", "2", "--hf_config", str(tmp_path)]
    assert main(args + ["--seq_len", "128", "--budget", "100GiB"]) == 0
    out = capsys.readouterr().out
    assert "ZeRO stage 0, 8 rank(s), micro-batch 8" in out
    assert "micro-batch 8, activation checkpointing" in out  # HF models are also planned with recomputation
    assert "recommended: stage 0, offload none, micro-batch 8" in out  # everything fits: the least traffic


def test_cli_rejects_a_factory_without_callable(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 1}')
    assert main(["--config", str(path), "--factory", "tests.unit.test_estimator"]) == 2
    assert "MODULE:CALLABLE" in capsys.readouterr().err


@pytest.mark.parametrize(
    "config_text, extra, message",
    [
        (None, ["--factory", "m:build"], "No such file or directory"),
        ("[1", ["--factory", "m:build"], "Expecting ',' delimiter"),
        ("[1]", ["--factory", "m:build"], "expected a JSON object, got list"),
        ('{"zero_optimization": {"stage": 7}}', ["--factory", "m:build"], "stage"),
        ("{}", ["--factory", "nosuch_module_x:fn"], "No module named 'nosuch_module_x'"),
        ("{}", ["--factory", "m:absent"], "has no attribute 'absent'"),
        ("{}", ["--hf_config", "missing-config.json"], "--hf_config missing-config.json: no such file or directory"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(tmp_path, monkeypatch, capsys, config_text, extra, message):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", list(__import__("sys").path))
    (tmp_path / "m.py").write_text("import torch\ndef build():\n    return torch.nn.Linear(4, 4)\n")
    if config_text is not None:
        (tmp_path / "ds.json").write_text(config_text)
    assert main(["--config", "ds.json", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zeroshard estimate: ") and message in err and "Traceback" not in err, err


@pytest.mark.parametrize("flag", ["--micro_batch", "--num_gpus", "--num_nodes", "--seq_len"])
def test_cli_refuses_counts_below_one(tmp_path, capsys, flag):
    (tmp_path / "ds.json").write_text("{}")
    with pytest.raises(SystemExit) as exit_:
        main(["--config", str(tmp_path / "ds.json"), "--factory", "m:build", flag, "0"])
    assert exit_.value.code == 2 and f"argument {flag}: must be >= 1, got 0" in capsys.readouterr().err


def test_cli_factory_module_in_the_working_directory(tmp_path, monkeypatch, capsys):
    """The console script's sys.path[0] is its bin directory: the working directory is searched as python -m does."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p not in ("", str(tmp_path))])
    (tmp_path / "my_models_here.py").write_text("import torch\ndef build():\n    return torch.nn.Embedding(600, 8)\n")
    (tmp_path / "ds.json").write_text('{"train_micro_batch_size_per_gpu": 1}')
    assert main(["--config", "ds.json", "--factory", "my_models_here:build"]) == 0
    assert "ZeRO stage 0" in capsys.readouterr().out


def test_cli_huge_layer_count_is_extended_linearly_and_exact_on_identical_blocks(tmp_path, capsys):
    """10^6 GPT-2 blocks answer at once (built and traced at 32 and 64 blocks); at 128 blocks the extension equals
    the estimate of the whole model."""
    from transformers import GPT2Config

    from zeroshard.estimator.cli import extend as _extend
    from zeroshard.estimator.cli import hf_config as _hf_config
    from zeroshard.estimator.cli import hf_model as _hf_model

    for layers in (128, 10**6):
        GPT2Config(n_layer=layers, n_embd=32, n_head=2, vocab_size=300, n_positions=64).save_pretrained(
            tmp_path / str(layers)
        )
    (tmp_path / "ds.json").write_text('{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}')
    args = ["--config", str(tmp_path / "ds.json"), "--num_gpus", "2", "--seq_len", "16"]
    assert main([*args, "--hf_config", str(tmp_path / str(10**6))]) == 0
    out = capsys.readouterr().out
    assert "1000000 layers: extended linearly from 32 and 64 layers" in out
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}
    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    inputs = {"input_ids": ids, "labels": ids}
    hf_config = _hf_config(str(tmp_path / "128"))
    whole = zeroshard.estimate(_hf_model(hf_config, False), config, 2, inputs)
    shallow, deep = (zeroshard.estimate(_hf_model(hf_config, False, n), config, 2, inputs) for n in (32, 64))
    extended = _extend(shallow, deep, 32, 128)
    assert extended.bytes == whole.bytes and extended.params == whole.params


def rows(printed: str) -> list[tuple[float, float, str]]:
    found = re.findall(r"^\s+([\d.]+)GB \|\s+([\d.]+)GB \| (.*)$", printed, re.M)
    return [(float(cpu), float(gpu), options) for cpu, gpu, options in found]


def test_deepspeed_zero3_table_for_t5_small(capsys):
    """DeepSpeed's documented output for t5-small (60,506,624 parameters, largest layer 16,449,536)."""
    from zeroshard.compat.deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_cold

    estimate_zero3_model_states_mem_needs_all_cold(60_506_624, 16_449_536, num_gpus_per_node=1, num_nodes=1)
    out = capsys.readouterr().out
    assert "SW: Model with 60M total params, 16M largest layer params." in out
    assert [(c, g) for c, g, _ in rows(out)] == [
        (1.52, 0.06),
        (1.52, 0.06),
        (1.35, 0.17),
        (1.35, 0.17),
        (0.09, 1.08),
        (0.34, 1.08),
    ]
    assert rows(out)[4][2] == "offload_param=none, offload_optimizer=none, zero_init=1"


def test_deepspeed_zero2_live_counts_the_model(capsys):
    from zeroshard.compat.deepspeed.runtime.zero.stage_1_and_2 import (
        estimate_zero2_model_states_mem_needs,
        estimate_zero2_model_states_mem_needs_all_live,
    )

    model = tiny_gpt()
    p = model.num_params()
    estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=4, num_nodes=2)
    out = capsys.readouterr().out
    assert "HW: Setup with 2 nodes, 4 GPUs per node." in out and len(rows(out)) == 2
    # DeepSpeed's formulas: offloaded, the CPU holds max(4 x GPUs, 16) bytes/param x the buffer factor
    assert estimate_zero2_model_states_mem_needs(p, 4, 2, cpu_offload=True) == (int(p * 32 * 1.5), 2 * p)
    assert estimate_zero2_model_states_mem_needs(p, 4, 2, cpu_offload=False) == (int(p * 16 * 1.5), 4 * p + 2 * p)


@pytest.mark.parametrize(
    "stage,optimizer,per_param",
    [(0, "OneBitAdam", 4.14), (2, "OneBitAdam", 4.14), (0, "ZeroOneAdam", 12.0), (0, "OneBitLamb", 4.0)],
)
def test_1bit_compression_state_is_in_the_estimate(stage, optimizer, per_param):
    """Worker + server error, one fp32 copy per compressed tensor (0/1 Adam: gradient and update errors plus its
    summed local updates), and 1-bit Adam's gathered momentum at 1/8 byte plus a scale per 256 elements (0.14);
    at stage 2 (4 ranks) the gradients grow from the shard to the whole flat (each rank keeps its own)."""

    def with_optimizer(name: str) -> dict:
        return {**config(stage), "optimizer": {"type": name, "params": {"lr": 1e-3}}}

    onebit = zeroshard.estimate(tiny_gpt, with_optimizer(optimizer), world_size=4, runtime_bytes=0)
    baseline = zeroshard.estimate(tiny_gpt, config(stage), world_size=4, runtime_bytes=0)
    extra = onebit.bytes["communication_buffers"]["device"] - baseline.bytes["communication_buffers"]["device"]
    assert extra / onebit.params == pytest.approx(per_param, rel=0.01)
    assert any(f"1-bit compression state: {per_param:.2f}" in note for note in onebit.notes)
    grads = onebit.bytes["gradients"]["device"] - baseline.bytes["gradients"]["device"]
    assert grads / onebit.params == pytest.approx(3.0 if stage else 0.0, abs=0.01)  # fp32: 4 x (1 - 1/4)


def test_frozen_weights_kept_as_int8_are_estimated_at_their_size():
    """zero_quantized_nontrainable_weights: frozen shards at 1 byte per element (plus a scale per 256)."""

    def frozen_gpt():
        model = tiny_gpt()
        for block in model.blocks:
            block.requires_grad_(False)
        return model

    def estimate(**zero):
        cfg = config(3, stage3_param_persistence_threshold=0, **zero)
        return zeroshard.estimate(frozen_gpt, cfg, world_size=2, runtime_bytes=0).bytes["parameters"]["device"]

    frozen = sum(p.numel() for p in frozen_gpt().blocks.parameters())
    saved = estimate() - estimate(zero_quantized_nontrainable_weights=True)
    assert saved == pytest.approx(frozen / 2 * (4 - 1 - 4 / 256), rel=0.02)


def test_a_model_that_cannot_be_copied_is_named_with_the_factory_way_out():
    import threading

    model = torch.nn.Linear(4, 4)
    model.lock = threading.Lock()  # as a module holding a process group: deepcopy refuses it
    with pytest.raises(TypeError, match="pass a zero-argument callable"):
        zeroshard.estimate(model, {"train_micro_batch_size_per_gpu": 1}, 1, runtime_bytes=0)


def nvme_config(path) -> dict:
    nvme = {"device": "nvme", "nvme_path": str(path)}
    zero = {"stage": 3, "offload_optimizer": nvme, "offload_param": {**nvme, "max_in_cpu": 0}}
    return {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}


def test_cli_with_nvme_offload_prints_the_disk_per_step_and_the_probed_bandwidth(tmp_path, capsys):
    (tmp_path / "ds.json").write_text(json.dumps(nvme_config(tmp_path)))
    args = ["--config", str(tmp_path / "ds.json"), "--factory", "tests.unit.test_estimator:tiny_gpt"]
    assert main([*args, "--disk_probe_mib", "4"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"disk per optimizer step: [\d.]+ GB read \+ [\d.]+ GB written; the nvme_path measured", out)
    assert os.listdir(tmp_path) == ["ds.json"]  # the probe's file was unlinked as it was opened
    assert main([*args, "--disk_probe_mib", "0"]) == 0 and "measured" not in capsys.readouterr().out


@pytest.mark.parametrize("value, message", [("-1", "must be 0-16384"), ("99999", "must be 0-16384"), ("x", "integer")])
def test_cli_refuses_a_bad_disk_probe_size(tmp_path, capsys, value, message):
    (tmp_path / "ds.json").write_text("{}")
    with pytest.raises(SystemExit) as exit_:
        main(["--config", str(tmp_path / "ds.json"), "--factory", "m:build", "--disk_probe_mib", value])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_cli_probe_on_an_unusable_nvme_path_is_one_line(tmp_path, capsys):
    """The config's nvme_path vanished after it was written (a careless user): a named error, exit 2."""
    gone = tmp_path / "gone"
    gone.mkdir()
    (tmp_path / "ds.json").write_text(json.dumps(nvme_config(gone)))
    gone.rmdir()
    assert main(["--config", str(tmp_path / "ds.json"), "--factory", "tests.unit.test_estimator:tiny_gpt"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zeroshard estimate: ") and "does not exist" in err and "Traceback" not in err
