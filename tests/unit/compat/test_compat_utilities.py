"""The small DeepSpeed utilities clients import (issue 40, part 2), called the way clients call them: the ALST
tutorial's ``move_to_device``, ``see_memory_usage``, ``clip_grad_norm_``, ArcticTraining's timers and checkpoint
engine, ms-swift's ``compute_elastic_config`` and ``git_version_info``, the monitor tutorial's ``DeepSpeedConfig`` +
``MonitorMaster``, Accelerate's ``DeepSpeedCPUAdagrad``, Lightning's ``zero_to_fp32`` file helpers and DeepSpeed's
``convert_zero_checkpoint_to_fp32_state_dict`` defaults (``pytorch_model.bin``), ArcticTraining's
``launcher.runner.EXPORT_ENVS``. Imported from ``zeroshard.compat.deepspeed`` directly (the alias maps
``deepspeed.<x>`` to these very modules; installing it would change this process)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from zeroshard.compat.deepspeed import git_version_info
from zeroshard.compat.deepspeed.monitor.monitor import MonitorMaster
from zeroshard.compat.deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
from zeroshard.compat.deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine
from zeroshard.compat.deepspeed.runtime.config import DeepSpeedConfig
from zeroshard.compat.deepspeed.runtime.utils import clip_grad_norm_, move_to_device, see_memory_usage
from zeroshard.compat.deepspeed.utils import zero_to_fp32
from zeroshard.compat.deepspeed.utils.timer import NoopTimer, SynchronizedWallClockTimer

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "deepspeed_checkpoints"


def test_move_to_device_as_the_alst_tutorial_calls_it():
    batch = {"input_ids": torch.ones(1, 3, dtype=torch.long), "extra": [torch.zeros(2), (torch.ones(1), "text")]}
    moved = move_to_device(batch, torch.device("cpu"))
    assert torch.equal(moved["input_ids"], batch["input_ids"]) and moved["extra"][1][1] == "text"
    assert isinstance(moved["extra"][1], tuple)
    tensor = torch.ones(2)
    same = move_to_device(tensor, "cpu", criterion_func=lambda t: torch.is_tensor(t))
    assert same is tensor  # selected tensors move in place, as DeepSpeed's


def test_see_memory_usage_prints_only_when_forced(capsys):
    see_memory_usage("quiet")
    assert capsys.readouterr().out == ""
    see_memory_usage("after step", force=True)
    printed = capsys.readouterr().out
    assert "after step" in printed and "host RSS" in printed


def test_clip_grad_norm_matches_torch_and_refuses_megatron_mpu():
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    b.load_state_dict(a.state_dict())
    for m in (a, b):
        m(torch.ones(2, 4) * 10).sum().backward()
    assert torch.equal(clip_grad_norm_(a.parameters(), 0.5), torch.nn.utils.clip_grad_norm_(b.parameters(), 0.5))
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters()))
    with pytest.raises(NotImplementedError, match="mpu"):
        clip_grad_norm_(a.parameters(), 1.0, mpu=object())
    with pytest.raises(ValueError, match="max_norm must be a finite number"):
        clip_grad_norm_(a.parameters(), float("nan"))


def test_synchronized_wall_clock_timers_as_arctic_training_uses_them(capsys):
    timers = SynchronizedWallClockTimer()
    timers("step").start()
    time.sleep(0.01)
    timers("step").stop()
    assert timers("step").mean() >= 10.0 * 0.5  # milliseconds (a loaded machine only makes it longer)
    assert timers("step").elapsed(reset=False) >= 5.0
    with pytest.raises(RuntimeError, match="'step' is not started"):
        timers("step").stop()
    timers("step").start()
    with pytest.raises(RuntimeError, match="already been started"):
        timers("step").start()
    timers("step").stop()
    timers.log(["step", "not-a-timer"])
    assert "time (ms) | step:" in capsys.readouterr().out
    assert timers.get_timers()["step"].elapsed() == 0.0  # log reset it
    with pytest.raises(ValueError, match="normalizer"):
        timers.log(["step"], normalizer=0)
    noop = NoopTimer()
    noop("x").start()
    assert noop("x").elapsed() == 0.0 and noop.get_timers() == {}


def test_the_checkpoint_engine_saves_atomically_and_never_unpickles_code(tmp_path):
    engine = TorchCheckpointEngine()
    path = tmp_path / "a b;$(touch pwned).pt"  # shell metacharacters are only a name here
    engine.save({"w": torch.arange(3.0), "step": 4}, str(path))
    assert torch.equal(engine.load(str(path))["w"], torch.arange(3.0)) and not list(tmp_path.glob("*.tmp"))
    assert engine.preserves_storage_sharing() and engine.commit(None) is True

    class RunsCode:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'ran'}",))

    torch.save({"evil": RunsCode()}, tmp_path / "evil.pt")
    from zeroshard.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match=r"refused to unpickle class (posix|os)\.system"):
        engine.load(str(tmp_path / "evil.pt"))
    assert not (tmp_path / "ran").exists() and not (tmp_path / "pwned").exists()


def test_git_version_info_answers_what_clients_read():
    assert git_version_info.version == "0.19.8"
    ops = git_version_info.installed_ops
    assert ops.get("cpu_adam") is True and ops["async_io"] is False
    assert set(git_version_info.torch_info) == {"version", "cuda_version", "nccl_version", "hip_version"}


def test_the_monitor_tutorial_writes_its_events(tmp_path):
    config = tmp_path / "ds_config.json"
    config.write_text(
        '{"train_batch_size": 8, "csv_monitor": {"enabled": true, "output_path": "%s", "job_name": "tutorial"}}'
        % (tmp_path / "logs")
    )
    ds_config = DeepSpeedConfig(str(config))
    monitor = MonitorMaster(ds_config.monitor_config)
    monitor.write_events([("Train/loss", 0.5, 1), ("Train/loss", 0.25, 2)])
    monitor.close()
    written = list((tmp_path / "logs" / "tutorial").glob("*.csv"))
    assert written and "0.25" in written[0].read_text()
    assert ds_config.train_batch_size == 8 and ds_config.zero_optimization_stage == 0
    with pytest.raises(NotImplementedError, match="mpu"):
        DeepSpeedConfig({"train_batch_size": 8}, mpu=object())


def test_cpu_adagrad_is_torch_adagrad_with_deepspeeds_arguments():
    a, b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
    b.load_state_dict(a.state_dict())
    ours = DeepSpeedCPUAdagrad(a.parameters(), lr=0.1, weight_decay=0.01)
    theirs = torch.optim.Adagrad(b.parameters(), lr=0.1, weight_decay=0.01, eps=1e-10)
    for _ in range(3):
        for m, opt in ((a, ours), (b, theirs)):
            m(torch.ones(1, 3)).square().sum().backward()
            opt.step()
            opt.zero_grad()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    with pytest.raises(NotImplementedError, match="amsgrad"):
        DeepSpeedCPUAdagrad(a.parameters(), amsgrad=True)


def test_zero_to_fp32_file_helpers_read_deepspeeds_layout():
    tag = FIXTURES / "stage3_fp32" / "ckpt" / "global_step2"
    assert zero_to_fp32.get_model_state_file(str(tag), 3).endswith("zero_pp_rank_0_mp_rank_00_model_states.pt")
    assert [Path(p).name for p in zero_to_fp32.get_optim_files(str(tag))] == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
    stage2 = FIXTURES / "stage2_fp32" / "ckpt" / "global_step2"
    assert zero_to_fp32.get_model_state_file(str(stage2), 2).endswith("/mp_rank_00_model_states.pt")
    with pytest.raises(FileNotFoundError, match="can't find model states file"):
        zero_to_fp32.get_model_state_file(str(stage2), 3)
    with pytest.raises(FileNotFoundError, match="doesn't exist"):
        zero_to_fp32.get_model_state_file(str(stage2 / "nope"), 2)


def test_deepspeeds_convert_defaults_write_pytorch_model_bin(tmp_path):
    from zeroshard.checkpoint import convert_deepspeed_checkpoint, get_fp32_state_dict_from_zero_checkpoint

    converted = Path(convert_deepspeed_checkpoint(str(FIXTURES / "stage2_fp32" / "ckpt"), str(tmp_path / "ck")))
    files = zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(str(converted.parent), str(tmp_path / "out"))
    assert [Path(f).name for f in files] == ["pytorch_model.bin"]
    loaded = torch.load(files[0], weights_only=True)  # tensors only: the restricted unpickler reads it
    expected = get_fp32_state_dict_from_zero_checkpoint(str(converted.parent))
    assert loaded.keys() == expected.keys() and all(torch.equal(loaded[k], expected[k]) for k in expected)
    safe = zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(
        str(converted.parent), str(tmp_path / "safe"), "10KB", True
    )  # DeepSpeed's positional order: max_shard_size, safe_serialization
    assert all(f.endswith((".safetensors", ".json")) for f in safe)
    with pytest.raises(NotImplementedError, match="exclude_frozen_parameters"):
        zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(
            str(converted.parent), str(tmp_path / "x"), exclude_frozen_parameters=True
        )


def test_the_launchers_export_envs_extend_what_every_node_gets():
    from zeroshard.compat.deepspeed.launcher import runner
    from zeroshard.launcher.multinode import exported_environment

    assert runner.EXPORT_ENVS == ["MLFLOW", "PYTHON", "MV2", "UCX"]
    environ = {"WANDB_PROJECT": "p", "MLFLOW_URI": "u", "HOME_SECRET": "s"}
    plain, _ = exported_environment(environ, {})
    extended, _ = exported_environment(environ, {}, tuple(runner.EXPORT_ENVS + ["WANDB"]))
    assert "WANDB_PROJECT" not in plain and extended["WANDB_PROJECT"] == "p" and "HOME_SECRET" not in extended


def test_zero_to_torch_writes_bf16_and_fp16_weights_as_deepspeed_0_19_8(tmp_path):
    """``python -m deepspeed.utils.zero_to_torch CKPT OUT --dtype bf16`` (DeepSpeed 0.19.8's converter)."""
    from zeroshard.checkpoint import convert_deepspeed_checkpoint, get_fp32_state_dict_from_zero_checkpoint
    from zeroshard.compat.deepspeed.utils import zero_to_torch

    converted = Path(convert_deepspeed_checkpoint(str(FIXTURES / "stage2_fp32" / "ckpt"), str(tmp_path / "ck")))
    expected = get_fp32_state_dict_from_zero_checkpoint(str(converted.parent))
    for name, dtype in (("bf16", torch.bfloat16), ("float16", torch.float16), ("fp32", torch.float32)):
        zero_to_torch.main([str(converted.parent), str(tmp_path / name), "--dtype", name, "--safe_serialization"])
        from safetensors.torch import load_file

        written = load_file(str(tmp_path / name / "model.safetensors"))
        assert written.keys() == expected.keys()
        for key, value in expected.items():
            assert written[key].dtype == (dtype if value.is_floating_point() else value.dtype)
            assert torch.equal(written[key], value.to(written[key].dtype))
    files = zero_to_fp32.convert_zero_checkpoint_to_state_dict(str(converted.parent), str(tmp_path / "pt"), "bf16")
    assert next(iter(torch.load(files[0], weights_only=True).values())).dtype == torch.bfloat16
    for bad in ("int8", "fp8", "bf16; rm -rf /", ""):
        with pytest.raises((ValueError, SystemExit)):
            zero_to_torch.main([str(converted.parent), str(tmp_path / "bad"), "--dtype", bad])
        with pytest.raises(ValueError, match="output dtype"):
            zero_to_fp32.convert_zero_checkpoint_to_state_dict(str(converted.parent), str(tmp_path / "bad"), bad)
    assert set(zero_to_fp32.OUTPUT_DTYPE_NAMES) == {"float32", "fp32", "float16", "fp16", "bfloat16", "bf16"}


def test_the_launcher_runners_hostfile_helpers_and_mpi_discovery(tmp_path, caplog):
    from zeroshard.compat.deepspeed import comm
    from zeroshard.compat.deepspeed.launcher import runner

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# workers\nworker-0 slots=4\nworker-1 slots=2\n")
    pool = runner.fetch_hostfile(str(hostfile))
    assert pool == {"worker-0": 4, "worker-1": 2}
    assert runner.parse_inclusion_exclusion(pool, "worker-1:1", "") == {"worker-1": [1]}
    assert runner.parse_inclusion_exclusion(pool, "", "worker-0") == {"worker-1": [0, 1]}
    with pytest.raises(ValueError):
        runner.parse_inclusion_exclusion(pool, "worker-1:7", "")  # a slot the host lacks
    assert runner.fetch_hostfile(str(tmp_path / "absent")) is None
    for bad in ("worker-0 slots=4\nworker-0 slots=2\n", "$(touch pwned) slots=1\n", "worker slots=99999999\n"):
        hostfile.write_text(bad)
        with pytest.raises(ValueError):
            runner.fetch_hostfile(str(hostfile))
    assert not (tmp_path / "pwned").exists()
    with pytest.raises(NotImplementedError, match="mpi_discovery.*OMPI_COMM_WORLD"):
        comm.mpi_discovery()
