"""Lightning drives zeroshard (`zeroshard.lightning`): Trainer fits on 2 CPU processes started by Lightning's own
launcher, match Lightning's DDP strategy with accumulation and clipping that triggers, resume from a checkpoint
directory, convert it for `load_from_checkpoint`; Fabric trains, saves and loads."""

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from zeroshard.testing import run_distributed
from zeroshard.testing.fixtures import module_from_file

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "distributed" / "scripts" / "lightning"
TOLERANCE = 1e-5


def start(*argv, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPTS / argv[0]), *map(str, argv[1:])],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )


def result(out) -> dict:
    """A launched run's RESULT line (its exit checked), or a reference computed in one process as it is."""
    if isinstance(out, dict):
        return out
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-8000:]
    line = next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


MIXED_PRECISION = [("class3", "16-mixed"), ("zeroshard_stage_3", "bf16-mixed")]
FP16_SKIPPED = 4  # of the 16-mixed run's 8 steps, while the dynamic loss scale comes down from 2^16 to 2^12
CLI_FIT = [
    "cli.py",
    "fit",
    "--trainer.accelerator=cpu",
    "--trainer.devices=2",
    "--trainer.strategy=zeroshard_stage_2_offload",
    "--trainer.max_steps=2",
    "--trainer.logger=false",
    "--trainer.enable_checkpointing=false",
    "--trainer.enable_progress_bar=false",
    "--optimizer.class_path=zeroshard.ops.adam.DeepSpeedCPUAdam",
    "--optimizer.init_args.lr=0.01",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every Lightning run the tests below read (each a 2-process job started by Lightning's own launcher), two at
    a time: one run alone leaves the cores idle about 40% of the time. The processes, not their results: each test
    checks its own run's exit. DDP's references run in one process beside them (``ddp_references``)."""
    base = tmp_path_factory.mktemp("lightning")
    fits = {
        "stage3": ["class3"],  # first: the resumed run starts from its checkpoint
        "stage2": ["zeroshard_stage_2"],
        "offload": ["zeroshard_stage_2_offload", "--cpu_adam"],
        "offload3": ["zeroshard_stage_3_offload", "--cpu_adam"],
    }
    jobs = {name: ["train.py", base / name, *args] for name, args in fits.items()}
    jobs["config_optimizer"] = ["train.py", base / "config_optimizer", "ignored", "--config_optimizer", "--epochs", "2"]
    for strategy, precision in MIXED_PRECISION:
        jobs[f"{strategy}-{precision}"] = [
            "train.py",
            base / precision,
            strategy,
            "--precision",
            precision,
            "--epochs",
            "2",
        ]
    jobs["fabric"] = ["fabric_train.py", base / "fabric", "zeroshard"]
    jobs["cli"] = CLI_FIT
    jobs["seed_onebit"] = ["seed_onebit.py", "200", "100"]
    jobs["hostile"] = ["hostile_checkpoint.py", base / "cwd-hostile"]  # writes into an existing directory
    resume = ["train.py", base / "resumed", "class3", "--resume", base / "stage3" / "ckpt" / "epoch=1-step=8.ckpt"]
    with ThreadPoolExecutor(2) as pool:
        references = pool.submit(run_distributed, ddp_references, 1, base)  # beside the launched runs
        started = {}
        for name, argv in jobs.items():
            (base / f"cwd-{name}").mkdir()
            started[name] = pool.submit(start, *argv, cwd=base / f"cwd-{name}")
        started["stage3"].result()
        (base / "cwd-resumed").mkdir()
        started["resumed"] = pool.submit(start, *resume, cwd=base / "cwd-resumed")
        outs = {name: future.result() for name, future in started.items()}
        outs.update(references.result()[0])
    outs["dirs"] = {name: base / name for name in fits}
    return outs


def ddp_references(base: Path) -> dict:
    """Lightning's DDP runs the tests compare with, each in one process (``--devices 1``: the batch of both ranks,
    the mean of their losses, which is what DDP's averaged gradient is the gradient of): Trainer fits for 4 epochs,
    and for 2 with a constant LR (the config block's optimizer), in bf16 autocast, and skipping the first steps (the
    fp16 run's overflows); Fabric's run."""
    train = module_from_file(SCRIPTS / "train.py", "lightning_train_reference")
    fabric = module_from_file(SCRIPTS / "fabric_train.py", "lightning_fabric_reference")
    fits = {
        "ddp": [],
        "ddp_constant_lr": ["--constant_lr", "--epochs", "2"],
        "ddp-bf16-mixed": ["--precision", "bf16-mixed", "--epochs", "2"],
        "ddp-32-true": ["--epochs", "2", "--skip_first", str(FP16_SKIPPED)],
    }
    out = {name: train.fit([str(base / name), "ddp", "--devices", "1", *argv]) for name, argv in fits.items()}
    out["fabric_ddp"] = fabric.run(str(base / "fabric_ddp"), "ddp", devices=1)
    for value in out.values():
        assert value.pop("global_zero")
    return out


@pytest.mark.parametrize("name", ["stage2", "stage3", "offload", "offload3"])
def test_trainer_matches_lightning_ddp(runs, name):
    reference, mine = result(runs["ddp"]), result(runs[name])
    assert mine["initial_loss"] == pytest.approx(reference["initial_loss"], rel=TOLERANCE)
    assert mine["full_loss"] == pytest.approx(reference["full_loss"], rel=TOLERANCE)
    assert mine["full_loss"] < 0.7 * mine["initial_loss"]
    assert mine["grad_norm"] > 0.5  # gradient_clip_val=0.5 clipped: a double loss division would show here
    assert mine["global_step"] == 16 and mine["lr"] == pytest.approx(0.01)  # scheduler stepped by Lightning
    assert mine["checkpoints"] == [f"epoch={e}-step={4 * (e + 1)}.ckpt" for e in range(4)]


def test_resume_from_checkpoint_directory_continues_exactly(runs):
    resumed = result(runs["resumed"])
    assert resumed["global_step"] == 16
    assert resumed["full_loss"] == pytest.approx(result(runs["stage3"])["full_loss"], rel=TOLERANCE)


def _script_module():
    return module_from_file(SCRIPTS / "train.py", "lightning_train_script")


def test_convert_then_load_from_checkpoint(runs, tmp_path):
    from zeroshard.lightning import convert_zero_checkpoint_to_fp32_state_dict

    script = _script_module()
    final = runs["dirs"]["stage3"] / "final.ckpt"
    assert final.is_dir()  # a sharded checkpoint directory, not a pickle
    convert_zero_checkpoint_to_fp32_state_dict(str(final), str(tmp_path / "model.pt"))
    model = script.Regressor.load_from_checkpoint(tmp_path / "model.pt", weights_only=False)
    assert model.hparams.hidden == 16 and model.hparams.lr == 0.02
    assert model.full_data_loss() == pytest.approx(result(runs["stage3"])["full_loss"], rel=TOLERANCE)
    weights = convert_zero_checkpoint_to_fp32_state_dict(str(final), str(tmp_path / "model.safetensors"))
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "model.safetensors")
    assert saved.keys() == weights.keys() and all(torch.equal(saved[k], model.state_dict()[k]) for k in saved)


def test_optimizer_from_the_config_block_trains_like_ddp(runs):
    """The config block's AdamW against DDP with the same optimizer: losses and the last gradient norm (before
    clipping: a gradient scaled 2x, which clipping and Adam would hide from the losses, shows there)."""
    out, reference = result(runs["config_optimizer"]), result(runs["ddp_constant_lr"])
    assert out["global_step"] == reference["global_step"] == 8 and out["lr"] == reference["lr"] == 0.02
    for key in ("initial_loss", "full_loss", "grad_norm"):
        assert out[key] == pytest.approx(reference[key], rel=TOLERANCE), key
    assert out["full_loss"] < 0.9 * out["initial_loss"]


# zeroshard's 16-bit runs against DDP: fp16 (loss-scaled, fp32 master weights) against fp32 DDP that skips the
# steps the loss scale skips (it comes down from 2^16), bf16 weights and compute (fp32 master weights) against
# DDP's bf16 autocast (fp32 weights)
MIXED_REFERENCE = {"16-mixed": ("ddp-32-true", 1e-2), "bf16-mixed": ("ddp-bf16-mixed", 5e-2)}


@pytest.mark.parametrize("strategy,precision", MIXED_PRECISION)
def test_mixed_precision_trains_like_ddp(runs, strategy, precision):
    out = result(runs[f"{strategy}-{precision}"])
    name, rel = MIXED_REFERENCE[precision]
    reference = result(runs[name])
    assert out["global_step"] == 8 and out["skipped_steps"] == reference["skipped_steps"]
    for key in ("initial_loss", "full_loss", "grad_norm"):
        assert out[key] == pytest.approx(reference[key], rel=rel), key


def test_fabric_trains_saves_and_loads_like_fabric_ddp(runs):
    reference, mine = result(runs["fabric_ddp"]), result(runs["fabric"])
    for key in ("initial", "trained", "moved", "restored"):
        assert mine[key] == pytest.approx(reference[key], rel=TOLERANCE), key
    assert mine["trained"] < 0.8 * mine["initial"] and mine["moved"] != mine["trained"]
    assert mine["restored"] == mine["trained"]  # fabric.load went back to the saved weights and optimizer
    assert mine["step"] == 5 and mine["best"] == pytest.approx(mine["trained"])  # plain values and tensors too


def test_lightning_cli_with_deepspeed_cpu_adam_class_path(runs):
    assert result(runs["cli"]) == {"optimizer": "CPUAdam", "steps": 2}


def seed_reference(steps: int, skipped: int) -> list[float]:
    """Rank 0's loss per step of the seed run in one fp32 process with torch alone: the script's net and data, each
    rank's batches as Lightning's DistributedSampler deals them (it shuffles training data, set_epoch each epoch),
    the ranks' gradients averaged, clipped at 1.0 (DeepSpeed's default), and DeepSpeed's 1-bit Adam update as its
    source writes it uncompressed (no bias correction, ``update = m / (sqrt(v) + eps) + weight_decay * p``) under
    its WarmupLR (``min_lr`` before the first step, then the log warm-up of the steps taken). The first ``skipped``
    steps (fp16 overflow while the loss scale comes down) change nothing, as in the run."""
    import math

    import torch.nn.functional as F

    script = module_from_file(SCRIPTS / "seed_onebit.py", "seed_onebit_script")
    settings = script.seed_config(100)["optimizer"]["params"]
    (b1, b2), eps, decay, top = settings["betas"], settings["eps"], settings["weight_decay"], settings["lr"]
    data = script.data(32)
    torch.manual_seed(0)  # the script's L.seed_everything(0)
    net = script.Regressor().net
    params = list(net.parameters())
    moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]
    samplers = [torch.utils.data.DistributedSampler(data, num_replicas=2, rank=r, shuffle=True) for r in (0, 1)]
    losses, applied = [], 0
    for step in range(steps):
        per_rank = []
        for sampler in samplers:
            sampler.set_epoch(step // 2)  # 2 batches of 8 per rank and epoch
            x, y = data[list(sampler)[(step % 2) * 8 : (step % 2 + 1) * 8]]
            per_rank.append(F.mse_loss(net(x), y))
        losses.append(per_rank[0].item())
        if step < skipped:
            continue
        net.zero_grad()
        (sum(per_rank) / 2).backward()
        norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params)).item()
        coef = min(1.0, 1.0 / (norm + 1e-6))
        lr = top * min(1.0, math.log(applied) / math.log(100)) if applied else 0.0
        with torch.no_grad():
            for p, (m, v) in zip(params, moments):
                g = p.grad * coef
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                p.add_(m / (v.sqrt() + eps) + decay * p, alpha=-lr)
        applied += 1
    return losses


def test_the_seed_configuration_trains_with_1bit_adam(runs):
    """The seed's DeepSpeed dict (OneBitAdam with cuda_aware, WarmupLR, ZeRO 2 + CPU offload, fp16) through
    ``ZeroshardStrategy(config=...)``; freeze_step lowered to 100 so the 1-bit phase starts within 200 steps. Its
    losses against one fp32 process running the uncompressed update (measured: 7e-4 in the warm-up, 1.1e-3 after,
    the 1-bit phase's compression error included)."""
    out = runs["seed_onebit"]
    outcome = result(out)
    losses = outcome["losses"]
    assert outcome["global_step"] == 200 and outcome["optimizer"] == "OneBitAdam"
    reference = seed_reference(outcome["global_step"], outcome["skipped_steps"])
    warm = outcome["compressed_from"] - 1  # global steps of exact averaging (fp16: the skipped ones included)
    assert max(abs(a - b) / b for a, b in zip(losses[:warm], reference[:warm])) <= 2e-3  # fp16 against fp32
    assert max(abs(a - b) / b for a, b in zip(losses[warm:], reference[warm:])) <= 1e-2  # and 1-bit compressed
    # 100 exact updates (fp16 overflow skips at the start do not count), then 1-bit from the next global step
    assert outcome["compressed_from"] == 100 + outcome["skipped_steps"] + 1
    ledger = outcome["ledger"]
    exact_calls, onebit_calls = ledger["reduce_scatter/shard"][0], ledger["reduce_scatter_1bit/shard"][0]
    assert exact_calls == outcome["compressed_from"] - 1 and onebit_calls == 200 - exact_calls
    assert "1-bit communication since start: reduce_scatter_1bit" in out.stdout  # the run logs the bytes
    assert out.stderr.count("have no effect") == 1  # cuda_aware: said once (rank 0) that it means nothing here


def test_hostile_pickles_never_run_through_trainer_or_fabric(runs):
    """Trainer.fit(ckpt_path=) passes weights_only=None, which once became weights_only=False: a pickle's
    __reduce__ ran. Fabric's load refuses a file outright."""
    out = result(runs["hostile"])
    assert out["ran"] is False, out
    assert out["trainer"].startswith("UnpicklingError: Weights only load failed"), out["trainer"]
    assert out["fabric"].startswith("ValueError: ") and "is a file" in out["fabric"], out["fabric"]
