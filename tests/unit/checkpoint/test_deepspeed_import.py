"""Importing DeepSpeed checkpoints (fixtures written by DeepSpeed 0.19.8, `tests/fixtures/deepspeed_checkpoints`):
the weights equal DeepSpeed's own zero_to_fp32 output bit for bit, the Adam moments and step equal what DeepSpeed
held; hostile and damaged files are refused by name with nothing run and nothing written."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from zeroshard.checkpoint import CheckpointError, convert_deepspeed_checkpoint, get_fp32_state_dict_from_zero_checkpoint
from zeroshard.checkpoint.reading import read_manifest
from zeroshard.testing.hostile import CodeRunningPickle

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "deepspeed_checkpoints"
CASES = [f"{o}stage{s}_{d}" for o in ("", "fused_adamw_", "fused_adam_", "cpuadam_adamw_") for s in (1, 2, 3)
         for d in ("fp32", "bf16")]  # fmt: skip


def expected(case: str) -> tuple[dict, dict]:
    return load_file(FIXTURES / case / "expected.safetensors"), json.loads(
        (FIXTURES / case / "expected.json").read_text()
    )


@pytest.mark.parametrize("case", CASES)
def test_import_holds_deepspeeds_weights_moments_step_scheduler_and_client_state(tmp_path, case):
    tensors, facts = expected(case)
    path = convert_deepspeed_checkpoint(str(FIXTURES / case / "ckpt"), str(tmp_path / "out"))
    assert (
        path == str(tmp_path / "out" / "global_step2") and (tmp_path / "out" / "latest").read_text() == "global_step2"
    )
    weights = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "out"))
    assert sorted(weights) == sorted(facts["names"])
    for name, value in weights.items():
        assert torch.equal(value, tensors[f"fp32.{name}"]), name  # DeepSpeed's zero_to_fp32, bit for bit
    manifest = read_manifest(path)
    stored = load_file(os.path.join(path, "rank00000.safetensors"))
    for name in facts["names"]:
        entry = manifest["params"][name]
        ((file, key, start, _, numel),) = entry["pieces"]
        for state in ("exp_avg", "exp_avg_sq"):
            moment = stored[f"optim.{state}.{key}"][start : start + numel].view(entry["shape"])
            assert torch.equal(moment, tensors[f"{state}.{name}"]), (name, state)
    scalars = [g["scalars"]["step"]["value"] for g in manifest["optimizer"]["flat_groups"]]
    assert scalars == [float(s) for s in facts["steps"]]
    assert manifest["optimizer"]["param_groups"][0]["lr"] == facts["lrs"][0]
    continued = len(facts["continued_losses_per_rank"][0])
    assert manifest["counters"]["global_steps"] == 2 == facts["global_steps"] - continued  # saved after 2 steps
    assert manifest["lr_scheduler"] == {"last_batch_iteration": 1}
    assert manifest["client_state"] == facts["client_state"]
    # the update rule, in the engine's vocabulary: DeepSpeed's "Adam" runs its Adams in AdamW mode by default
    assert manifest["optimizer"]["type"] == "AdamW"
    hyper = manifest["optimizer"]["param_groups"][0]
    assert hyper["decoupled_weight_decay"] is True and not {"bias_correction", "step"} & set(hyper)


def _rewrite_config(ds: Path, optimizer: dict) -> None:
    """DeepSpeed's ds_config in the model states, changed the way another run's config would differ."""
    from zeroshard.checkpoint.deepspeed_record import read_deepspeed_file

    for model in (ds / "global_step2").glob("*model_states.pt"):
        data = read_deepspeed_file(str(model))
        data["ds_config"] = {**data["ds_config"], "optimizer": optimizer}
        torch.save(data, model)


def test_the_update_rule_follows_deepspeeds_adam_w_mode(tmp_path):
    ds = _copy(tmp_path, "fused_adam_stage2_fp32")
    _rewrite_config(ds, {"type": "Adam", "params": {"lr": 1e-2, "adam_w_mode": False}})
    manifest = read_manifest(convert_deepspeed_checkpoint(str(ds), str(tmp_path / "l2")))
    assert manifest["optimizer"]["type"] == "Adam"
    assert manifest["optimizer"]["param_groups"][0]["decoupled_weight_decay"] is False
    _rewrite_config(ds, {"type": "Adam", "params": {"adam_w_mode": "no"}})
    with pytest.raises(CheckpointError, match="'optimizer.params.adam_w_mode' is 'no'"):
        convert_deepspeed_checkpoint(str(ds), str(tmp_path / "bad"))


def test_adam_without_bias_correction_or_with_amsgrad_is_refused_by_name():
    from zeroshard.checkpoint.deepspeed_record import hyperparameters as _hyperparameters

    fused = {"lr": 1e-3, "bias_correction": True, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.0, "step": 7}
    assert _hyperparameters("ck", 0, fused, "Adam") == {
        "lr": 1e-3, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.0, "decoupled_weight_decay": False
    }  # fmt: skip
    with pytest.raises(CheckpointError, match="ck: parameter group 1 ran Adam with bias_correction false"):
        _hyperparameters("ck", 1, {**fused, "bias_correction": False}, "AdamW")
    with pytest.raises(CheckpointError, match="amsgrad"):
        _hyperparameters("ck", 0, {**fused, "amsgrad": True}, "AdamW")


@pytest.mark.parametrize("case", ["fused_adamw_stage1_fp32", "fused_adamw_stage2_bf16", "cpuadam_adamw_stage3_fp32"])
@pytest.mark.parametrize("damage", ["swapped", "copied"])
def test_swapped_or_copied_rank_files_are_refused(tmp_path, case, damage):
    ds = _copy(tmp_path, case)
    prefix = "bf16_" if case.endswith("bf16") else ""
    files = [ds / "global_step2" / f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)]
    first, second = files[0].read_bytes(), files[1].read_bytes()
    files[0].write_bytes(second)
    if damage == "swapped":
        files[1].write_bytes(first)
    message = "copy of the other" if damage == "copied" and "stage3" in case else "swapped or copied|swapped, copied"
    with pytest.raises(CheckpointError, match=message):
        convert_deepspeed_checkpoint(str(ds), str(tmp_path / "out"))
    assert not (tmp_path / "out" / "global_step2").exists()


def _copy(tmp_path: Path, case: str = "stage2_fp32") -> Path:
    target = tmp_path / "ds"
    shutil.copytree(FIXTURES / case / "ckpt", target)
    return target


def test_a_pickle_with_a_foreign_class_is_refused_and_nothing_runs(tmp_path):
    ds, marker = _copy(tmp_path), tmp_path / "ran"
    model = ds / "global_step2" / "mp_rank_00_model_states.pt"
    torch.save({"param_shapes": [], "evil": CodeRunningPickle(marker)}, model)
    with pytest.raises(
        CheckpointError, match=r"mp_rank_00_model_states.pt: refused to unpickle class (posix|os)\.system"
    ):
        convert_deepspeed_checkpoint(str(ds), str(tmp_path / "out"))
    assert not marker.exists() and not (tmp_path / "out" / "global_step2").exists()


def test_damaged_missing_and_misnamed_inputs_are_named_and_nothing_is_written(tmp_path):
    ds = _copy(tmp_path)
    optim = ds / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    optim.write_bytes(optim.read_bytes()[:300])
    with pytest.raises(CheckpointError, match="zero_pp_rank_1_mp_rank_00_optim_states.pt: damaged or truncated"):
        convert_deepspeed_checkpoint(str(ds), str(tmp_path / "out"))
    optim.unlink()
    with pytest.raises(CheckpointError, match="rank 1's optimizer states .* are missing"):
        convert_deepspeed_checkpoint(str(ds), str(tmp_path / "out"))
    with pytest.raises(CheckpointError, match="is not a plain name"):
        convert_deepspeed_checkpoint(str(ds), str(tmp_path / "out"), tag="../ds")
    (ds / "latest").unlink()
    with pytest.raises(CheckpointError, match="no 'latest' file; pass the tag"):
        convert_deepspeed_checkpoint(str(ds), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_an_existing_checkpoint_is_never_replaced(tmp_path):
    out = tmp_path / "out"
    convert_deepspeed_checkpoint(str(FIXTURES / "stage1_fp32" / "ckpt"), str(out))
    before = (out / "global_step2" / "manifest.json").read_bytes()
    with pytest.raises(CheckpointError, match="exists; convert into another directory"):
        convert_deepspeed_checkpoint(str(FIXTURES / "stage2_fp32" / "ckpt"), str(out))
    assert (out / "global_step2" / "manifest.json").read_bytes() == before


def test_the_cli_converts_and_reports_errors_by_exit_code(tmp_path):
    command = [sys.executable, "-m", "zeroshard", "convert", "--from-deepspeed"]
    ok = subprocess.run(
        [*command, str(FIXTURES / "stage3_fp32" / "ckpt"), str(tmp_path / "o")], capture_output=True, text=True
    )
    assert ok.returncode == 0 and ok.stdout.strip().endswith("global_step2"), ok.stderr
    bad = subprocess.run([*command, str(tmp_path / "missing"), str(tmp_path / "p")], capture_output=True, text=True)
    assert bad.returncode == 2 and "no 'latest' file" in bad.stderr
