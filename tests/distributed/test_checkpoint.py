"""Checkpoints: bit-identical resume, resharding across world sizes and stages, crash safety,
corruption errors, consolidation to fp32 / safetensors, the convert CLI."""

import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch

from zeroshard.accelerator import host_peak_rss
from zeroshard.testing import WorkerError, run_distributed
from zeroshard.testing.parity import ParityCase, make_batches, make_model, model_error

UNITS = (("gather_unit_classes", ["Block"]), ("stage3_param_persistence_threshold", 0))
SCHEDULE = {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_max_lr": 1e-3}}
STEPS, SPLIT = 6, 3


def build(case):
    import zeroshard

    cfg = case.config()
    cfg["scheduler"] = SCHEDULE
    engine, _, _, _ = zeroshard.initialize(model=make_model(), config=cfg)
    return engine


def train(engine, steps: range, global_batch: int):
    from zeroshard import comm

    rank, world, gas = comm.get_rank(), comm.get_world_size(), engine.gradient_accumulation_steps()
    micro = global_batch // (world * gas)
    batches = make_batches(STEPS, global_batch)
    for step in steps:
        x, y = batches[step]
        for k in range(gas):
            rows = slice((k * world + rank) * micro, (k * world + rank + 1) * micro)
            engine.backward(engine(x[rows], y[rows]))
            engine.step()


def optimizer_state(engine):
    zero = engine.stack
    return [{**zero.read_flat(k), **zero.flat_scalars(k)} for k in range(len(zero.flat_groups))]


def run_phase(cases, directory, phase):
    """``straight``: each case trains uninterrupted, and a second engine trains the first steps and saves (one
    spawn for both); ``load``: a fresh process resumes each saved case."""
    out = []
    for index, case in enumerate(cases):
        engine = build(case)
        path = os.path.join(directory, str(index))
        if phase == "straight":
            train(engine, range(STEPS), 4 * case.gas)
            saver = build(case)
            train(saver, range(SPLIT), 4 * case.gas)
            saver.save_checkpoint(path, client_state={"epoch": 1, "note": "halfway"})
            saver.destroy()
        else:
            loaded, client = engine.load_checkpoint(path)
            assert client == {"epoch": 1, "note": "halfway"} and loaded.endswith(f"global_step{SPLIT}")
            train(engine, range(SPLIT, STEPS), 4 * case.gas)
        out.append(
            {
                "params": engine.consolidated_state_dict(rank0_only=False),
                "opt": optimizer_state(engine),
                "lr": engine.get_lr(),
                "steps": (engine.global_steps, engine.global_samples),
                "scale": engine.stack.loss_scaler.state_dict(),
            }
        )
    return out


ROUND_TRIP = [
    ParityCase(stage=s, dtype=d, gas=2, lr=1e-3, zero=UNITS if s == 3 else ())
    for s in (0, 1, 2, 3)
    for d in ("fp32", "bf16")
]
ROUND_TRIP.append(ParityCase(stage=2, dtype="fp16", gas=2, lr=1e-3))
SWAP = tempfile.gettempdir()  # swap files are unlinked as soon as they are opened
CPU_OFFLOAD = (("offload_optimizer", {"device": "cpu"}), ("sub_group_size", 3000))
NVME_OFFLOAD = (
    ("offload_optimizer", {"device": "nvme", "nvme_path": SWAP, "buffer_count": 2}),
    ("offload_param", {"device": "nvme", "nvme_path": SWAP, "max_in_cpu": 0}),
    ("sub_group_size", 3000),
)
ROUND_TRIP += [
    ParityCase(stage=2, gas=2, lr=1e-3, zero=CPU_OFFLOAD),
    ParityCase(stage=3, dtype="bf16", gas=2, lr=1e-3, zero=UNITS + NVME_OFFLOAD),
    ParityCase(stage=3, gas=2, lr=1e-3, zero=UNITS + NVME_OFFLOAD[:2]),  # fp32 shards that are their own masters
    ParityCase(stage=3, gas=2, lr=1e-3, zero=UNITS + NVME_OFFLOAD[::2]),  # the step runs behind the next forward
]


def test_resume_is_bit_identical_to_uninterrupted_training(tmp_path):
    straight = run_distributed(run_phase, 2, ROUND_TRIP, str(tmp_path), "straight")[0]
    resumed = run_distributed(run_phase, 2, ROUND_TRIP, str(tmp_path), "load")[0]
    for case, a, b in zip(ROUND_TRIP, straight, resumed):
        label = f"stage {case.stage} {case.dtype} {case.zero}"
        assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"]), label
        for sa, sb in zip(a["opt"], b["opt"]):
            assert sa.keys() == sb.keys(), label
            for key in sa:
                assert torch.equal(torch.as_tensor(sa[key]), torch.as_tensor(sb[key])), (label, key)
        assert a["lr"] == b["lr"] and a["steps"] == b["steps"] and a["scale"] == b["scale"], label


def reshard_worker(save_case, directory, phase, load_case=None):
    engine = build(save_case if phase == "save" else load_case)
    if phase == "save":
        train(engine, range(SPLIT), 8)
        engine.save_checkpoint(directory)
        return None
    engine.load_checkpoint(directory)
    train(engine, range(SPLIT, STEPS), 8)
    return engine.consolidated_state_dict(rank0_only=False)


RESHARD = [
    # (save world, save case, load world, load case); global batch 8 throughout
    (4, ParityCase(stage=2, lr=1e-3), 2, ParityCase(stage=3, gas=2, lr=1e-3, zero=UNITS)),
    (4, ParityCase(stage=2, lr=1e-3), 1, ParityCase(stage=0, gas=4, lr=1e-3)),
    (2, ParityCase(stage=3, gas=2, lr=1e-3, zero=UNITS), 4, ParityCase(stage=3, lr=1e-3, shard_size=2, zero=UNITS)),
    # offloaded state is stored like any other: NVMe-offloaded stage 3 resumes as CPU-offloaded stage 1
    (
        2,
        ParityCase(stage=3, gas=2, lr=1e-3, zero=UNITS + NVME_OFFLOAD),
        2,
        ParityCase(stage=1, gas=2, lr=1e-3, zero=CPU_OFFLOAD),
    ),
]


@pytest.mark.parametrize(
    "save_world,save_case,load_world,load_case",
    RESHARD,
    ids=["4xstage2-to-2xstage3", "4xstage2-to-1xstage0", "2xstage3-to-4xhybrid", "nvme-stage3-to-cpu-offload-stage1"],
)
def test_resharded_resume_matches_uninterrupted(saved, save_world, save_case, load_world, load_case):
    directory = saved(save_world, save_case)
    got = run_distributed(reshard_worker, load_world, save_case, directory, "load", load_case)[0]
    assert model_error({k: v.float() for k, v in got.items()}, _schedule_reference()) <= 1e-5


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The checkpoint a (world, case) saves after the first steps, saved once for every load of it."""
    directories = {}

    def save(world: int, case: ParityCase) -> str:
        key = (world, repr(case))
        if key not in directories:
            directory = str(tmp_path_factory.mktemp("reshard"))
            run_distributed(reshard_worker, world, case, directory, "save")
            directories[key] = directory
        return directories[key]

    return save


def _schedule_reference():
    """Single-process reference with the same WarmupLR schedule (the engine's)."""
    from zeroshard.optim import build_schedule

    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = build_schedule(SCHEDULE["type"], SCHEDULE["params"], opt)
    for x, y in make_batches(STEPS, 8):
        model(x, y).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return model.state_dict()


def crash_worker(directory, tag, crash_before_replace=0):
    """Save ``tag``; with ``crash_before_replace`` = k, rank 0 dies (like SIGKILL) just before the k-th rename
    of the save (the test owns this fault-injection seam: it wraps ``os.replace`` in this process only)."""
    from zeroshard import comm

    engine = build(ParityCase(stage=2, lr=1e-3))
    train(engine, range(1), 4)
    if crash_before_replace and comm.get_rank() == 0:
        calls, replace = [0], os.replace

        def dying_replace(src, dst):
            calls[0] += 1
            if calls[0] == crash_before_replace:
                os._exit(137)
            replace(src, dst)

        os.replace = dying_replace
    engine.save_checkpoint(directory, tag=tag)
    return crash_before_replace and comm.get_rank() == 0  # True: the save finished before the k-th rename


def load_latest_worker(directories):
    out = []
    for directory in directories:
        engine = build(ParityCase(stage=2, lr=1e-3))
        path, _ = engine.load_checkpoint(directory)
        out.append(path)
    return out


def test_a_crash_at_any_point_of_a_save_leaves_a_loadable_latest(tmp_path):
    """Re-saving the tag that 'latest' names (the riskiest case) and saving a new tag, killed before each of
    the save's renames in turn: 'latest' always names a complete checkpoint that loads."""
    import shutil

    base = tmp_path / "base"
    run_distributed(crash_worker, 1, str(base), "first")
    crashed = []
    for new_tag in ("first", "second"):
        for k in range(1, 10):
            directory = tmp_path / f"{new_tag}-{k}"
            shutil.copytree(base, directory)
            try:
                finished = run_distributed(crash_worker, 1, str(directory), new_tag, k)[0]
            except WorkerError as err:
                assert "exited with code 137" in str(err)
                crashed.append(directory)
                continue
            assert finished  # the save had fewer than k renames: every crash point was covered
            break
    assert len(crashed) >= 8
    loaded = run_distributed(load_latest_worker, 1, [str(d) for d in crashed])[0]
    for directory, path in zip(crashed, loaded):
        assert path is not None and os.path.dirname(path) == str(directory)


def corrupt_load_worker(directory):
    from zeroshard.checkpoint import CheckpointError

    engine = build(ParityCase(stage=2, lr=1e-3))
    try:
        engine.load_checkpoint(directory)
    except CheckpointError as err:
        return str(err)
    return None


def wrong_model_worker(directory):
    import zeroshard
    from zeroshard.checkpoint import CheckpointError
    from zeroshard.testing.models import GPT, GPTConfig

    engine, _, _, _ = zeroshard.initialize(
        model=GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32)),
        config=ParityCase(stage=2).config(),
    )
    try:
        engine.load_checkpoint(directory)
    except CheckpointError as err:
        return str(err)
    return None


def test_corrupted_truncated_missing_and_mismatched_checkpoints_fail_clearly(tmp_path):
    run_distributed(crash_worker, 2, str(tmp_path), "good")
    rank1 = tmp_path / "good" / "rank00001.safetensors"
    original = rank1.read_bytes()

    data = bytearray(original)
    data[-20] ^= 0xFF  # flip a byte inside the last tensor (rank 1's RNG state)
    rank1.write_bytes(bytes(data))
    r0, r1 = run_distributed(corrupt_load_worker, 2, str(tmp_path))
    assert "rank00001.safetensors: tensor 'rng.cpu' fails its checksum" in r1
    assert "failed on rank(s) [1]" in r0  # the other rank fails too, instead of hanging

    rank1.write_bytes(original[: len(original) // 2])
    msg = run_distributed(corrupt_load_worker, 2, str(tmp_path))[1]
    assert "rank00001.safetensors" in msg and "truncated" in msg

    rank1.unlink()
    assert "rank00001.safetensors is missing" in run_distributed(corrupt_load_worker, 2, str(tmp_path))[1]

    rank1.write_bytes(original)
    msg = run_distributed(wrong_model_worker, 2, str(tmp_path))[0]
    assert "checkpoint does not match the model" in msg and "blocks.1" in msg


def no_checkpoint_worker(directory):
    import warnings

    engine = build(ParityCase(stage=1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = engine.load_checkpoint(directory)
    return result, [str(w.message) for w in caught]


def test_loading_from_an_empty_directory_returns_none_with_a_warning(tmp_path):
    result, messages = run_distributed(no_checkpoint_worker, 2, str(tmp_path))[0]
    assert result == (None, None) and any("no checkpoint to load" in m for m in messages)


def consolidation_worker(directory):
    engine = build(ParityCase(stage=3, lr=1e-3, zero=UNITS))
    train(engine, range(2), 4)
    engine.save_checkpoint(directory)
    return engine.consolidated_state_dict(rank0_only=False), None


def test_consolidation_to_fp32_state_dict_and_safetensors(tmp_path):
    from safetensors.torch import load_file

    import zeroshard

    full, _ = run_distributed(consolidation_worker, 2, str(tmp_path / "ckpt"))[0]
    state = zeroshard.checkpoint.get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt")  # a Path, or a str
    assert set(state) == set(full)  # tied lm_head.weight included
    for name, tensor in full.items():  # fp32 run: the master weights are the model weights
        assert torch.equal(state[name], tensor.float()), name
    model = zeroshard.checkpoint.load_state_dict_from_zero_checkpoint(make_model(seed=5), str(tmp_path / "ckpt"))
    assert torch.equal(model.blocks[0].fc.weight, full["blocks.0.fc.weight"])

    files = zeroshard.checkpoint.convert_zero_checkpoint_to_fp32_state_dict(
        tmp_path / "ckpt", tmp_path / "one.safetensors"
    )
    loaded = load_file(files[0])
    assert all(torch.equal(loaded[k], state[k]) for k in loaded) and "wte.weight" in loaded

    files = zeroshard.checkpoint.convert_zero_checkpoint_to_fp32_state_dict(
        str(tmp_path / "ckpt"), str(tmp_path / "hf"), max_shard_size="40KB"
    )
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(files) > 2 and set(index["weight_map"]) == set(loaded)
    merged = {}
    for name in set(index["weight_map"].values()):
        merged.update(load_file(tmp_path / "hf" / name))
    assert all(torch.equal(merged[k], state[k]) for k in merged)

    out = subprocess.run(
        [sys.executable, "-m", "zeroshard", "convert", str(tmp_path / "ckpt"), str(tmp_path / "cli.safetensors")],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert "convert: 100%" in out.stderr  # the progress bar, in bytes written
    assert all(torch.equal(v, loaded[k]) for k, v in load_file(tmp_path / "cli.safetensors").items())
    out = subprocess.run(
        [sys.executable, "-m", "zeroshard", "convert", str(tmp_path / "nothing"), str(tmp_path / "x.safetensors")],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "has no 'latest' file" in out.stderr


def big_checkpoint_worker(directory):
    import zeroshard
    from zeroshard.testing.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=4096, block_size=64, n_layer=6, n_head=8, n_embd=1024))
    cfg = {"train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.0}}}
    engine, _, _, _ = zeroshard.initialize(model=model, config=cfg)
    engine.save_checkpoint(directory)
    return max(p.numel() for p in model.parameters()) * 4, sum(p.numel() for p in model.parameters()) * 4


def convert_worker(directory, output):
    import zeroshard

    before = host_peak_rss()
    zeroshard.checkpoint.convert_zero_checkpoint_to_fp32_state_dict(directory, output)
    return host_peak_rss() - before


def test_conversion_memory_is_bounded_by_the_largest_tensor(tmp_path):
    """Measured: a 319 MB model converts with 54 MB of extra peak memory (largest tensor 16.8 MB)."""
    largest, total = run_distributed(big_checkpoint_worker, 1, str(tmp_path / "ckpt"))[0]
    peak = run_distributed(convert_worker, 1, str(tmp_path / "ckpt"), str(tmp_path / "out"))[0]
    assert total > 300e6
    assert peak < 4 * largest + (16 << 20), (peak, largest, total)  # never the model: a few tensors + a buffer
    assert (tmp_path / "out" / "model.safetensors").stat().st_size > total


def hf_gpt2_worker(directory):
    from transformers import GPT2Config, GPT2LMHeadModel

    import zeroshard

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    ds = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": 3,
            "gather_unit_classes": ["GPT2Block"],
            "stage3_param_persistence_threshold": 0,
        },
    }
    engine, _, _, _ = zeroshard.initialize(model=model, config=ds)
    x = torch.randint(0, 64, (2, 8))
    engine.backward(engine(input_ids=x, labels=x).loss)
    engine.step()
    engine.save_checkpoint(os.path.join(directory, "ckpt"))
    config.save_pretrained(os.path.join(directory, "hf"))
    return engine.consolidated_state_dict(rank0_only=False)


def test_converted_checkpoint_loads_with_transformers_from_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers")
    import zeroshard

    full = run_distributed(hf_gpt2_worker, 2, str(tmp_path))[0]
    zeroshard.checkpoint.convert_zero_checkpoint_to_fp32_state_dict(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    model = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf"))
    state = model.state_dict()
    assert set(full) == set(state)
    assert all(torch.equal(state[k], full[k].float()) for k in full)


def sampler_worker(directory, phase):
    import zeroshard

    data = torch.utils.data.TensorDataset(torch.arange(48).float().unsqueeze(1))
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.0}}}
    engine, _, loader, _ = zeroshard.initialize(model=torch.nn.Linear(1, 1), training_data=data, config=cfg)
    loader.sampler.set_epoch(1)
    seen = []
    if phase == "load":
        engine.load_checkpoint(directory)
    for (batch,) in loader:
        seen += [int(v) for v in batch.flatten()]
        engine.backward(engine(batch).sum())
        engine.step()
        if phase == "save" and len(seen) == 6:
            engine.save_checkpoint(directory)
            break
    engine.destroy()
    return seen


def sampler_straight_and_save_worker(directory):
    """The uninterrupted epoch, and a run that saves after 6 samples, in one spawn."""
    return sampler_worker(directory, "straight"), sampler_worker(directory, "save")


def test_data_loader_position_resumes_mid_epoch(tmp_path):
    both = run_distributed(sampler_straight_and_save_worker, 2, str(tmp_path))
    rest = run_distributed(sampler_worker, 2, str(tmp_path), "load")
    for rank in range(2):
        straight, first = both[rank]
        assert first + rest[rank] == straight


def disk_full_worker(directory):
    """The first save succeeds; during the second, rank 1's file-size limit (as a full disk would) stops its
    write. Every rank must raise one error naming the directory and what was kept."""
    import resource
    import signal

    from zeroshard import comm
    from zeroshard.checkpoint import CheckpointError

    engine = build(ParityCase(stage=2, lr=1e-3))
    train(engine, range(1), 4)
    engine.save_checkpoint(directory, tag="first")
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    if comm.get_rank() == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limit[1]))
    try:
        engine.save_checkpoint(directory, tag="second")
    except CheckpointError as err:
        return str(err)
    finally:  # the harness's result file and the process group's file store need the space afterwards
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
    return None


def test_disk_full_during_save_names_the_path_and_keeps_the_previous_checkpoint(tmp_path):
    messages = run_distributed(disk_full_worker, 2, str(tmp_path))
    for message in messages:
        assert message is not None and f"into {tmp_path} failed on rank(s) [1]" in message, message
        assert "the previous checkpoint 'first' is kept" in message and "removed" in message
    assert "File too large" in messages[1]
    assert sorted(os.listdir(tmp_path)) == ["first", "latest"]  # no .second.tmp left behind
    assert run_distributed(load_latest_worker, 2, [str(tmp_path)])[0] == [str(tmp_path / "first")]


def split_directory_worker(directory):
    from zeroshard import comm

    engine = build(ParityCase(stage=2, lr=1e-3))
    try:
        engine.save_checkpoint(os.path.join(directory, f"run-{comm.get_rank()}"))
    except ValueError as err:
        return str(err)
    return None


def test_save_dir_that_differs_between_ranks_is_one_clear_error(tmp_path):
    messages = run_distributed(split_directory_worker, 2, str(tmp_path))
    for message in messages:
        assert f"rank 0: {tmp_path}/run-0, rank 1: {tmp_path}/run-1" in message, message
    assert os.listdir(tmp_path) == []


def precision_switch_worker(directory):
    """Save in one precision, resume in the other: the loss scale comes from *this* run's config."""
    import contextlib
    import io

    out = {}
    for saved, resumed in (("fp32", "fp16"), ("fp16", "fp32")):
        engine = build(ParityCase(stage=2, lr=1e-3, dtype=saved))
        train(engine, range(1), 4)
        path = os.path.join(directory, f"{saved}-to-{resumed}")
        engine.save_checkpoint(path)
        engine = build(ParityCase(stage=2, lr=1e-3, dtype=resumed))
        log = io.StringIO()
        with contextlib.redirect_stdout(log):
            engine.load_checkpoint(path)
        out[resumed] = (engine.get_loss_scale(), log.getvalue())
    return out


def test_loss_scale_after_switching_precision(tmp_path):
    out = run_distributed(precision_switch_worker, 2, str(tmp_path))[0]
    scale, log = out["fp16"]
    assert scale == 2.0**8  # the fp16 config's initial_scale_power (8 in ParityCase), not the fp32 run's 1.0
    assert "reset loss scale to 256 from the fp16 config (the checkpoint ran without fp16)" in log, log
    scale, log = out["fp32"]
    assert scale == 1.0 and "dropped the checkpoint's fp16 loss scale" in log, log
    assert "restored step 1" in log


def gained_layer_worker(directory):
    import contextlib
    import io

    import zeroshard
    from zeroshard.testing.models import GPTConfig
    from zeroshard.testing.parity import MODEL

    engine = build(ParityCase(stage=2, lr=1e-3))
    train(engine, range(1), 4)
    engine.save_checkpoint(directory)
    saved = engine.consolidated_state_dict(rank0_only=False)
    bigger = make_model(seed=5, model=GPTConfig(**{**MODEL.__dict__, "n_layer": MODEL.n_layer + 1}))
    fresh = {k: v.clone() for k, v in bigger.state_dict().items()}
    config = ParityCase(stage=2, lr=1e-3).config()
    engine, *_ = zeroshard.initialize(model=bigger, config=config)
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        engine.load_checkpoint(directory, load_module_strict=False)
    loaded = engine.consolidated_state_dict(rank0_only=False)
    try:
        engine.load_checkpoint(directory)  # strict (the default) still refuses
        strict = None
    except Exception as err:
        strict = str(err)
    return saved, fresh, loaded, log.getvalue(), strict


def test_load_non_strict_into_a_model_that_gained_a_layer(tmp_path):
    saved, fresh, loaded, log, strict = run_distributed(gained_layer_worker, 2, str(tmp_path))[0]
    new = [k for k in loaded if k.startswith("blocks.2.")]
    assert new and all(torch.equal(loaded[k], fresh[k]) for k in new)  # kept as initialized
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)  # everything else restored
    assert "kept as initialized (not in the checkpoint) ['blocks.2." in log and "ignored (not in the model) []" in log
    assert strict is not None and "missing from checkpoint ['blocks.2." in strict


def auto_resume_worker(directory: str) -> dict:
    """One spawn, four engines on one save_dir: (A) trains 4 steps saving every 2 with its client state; 'latest' is
    deleted and junk added; (B) must resume from the newest complete checkpoint, not from step 0; 'latest' is set
    back to step 2; (C) resumes there and, reaching step 4 again, must keep A's global_step4, not overwrite it."""
    import zeroshard
    from zeroshard import comm

    save_dir = os.path.join(directory, "run")
    config = {
        **ParityCase(stage=2).config(),
        "checkpoint": {"save_dir": save_dir, "save_interval_steps": 2, "auto_resume": True},
    }
    rank = comm.get_rank()

    def engine_and_train(steps: int):
        engine, *_ = zeroshard.initialize(model=make_model(), config=config)
        engine.checkpoint_client_state = lambda: {"step": engine.global_steps, "note": "periodic"}
        batches = make_batches(8, 4)
        for step in range(engine.global_steps, engine.global_steps + steps):
            x, y = batches[step]
            engine.backward(engine(x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]))
            engine.step()
        return engine

    out = {}
    first = engine_and_train(4)
    out["A"] = {n: p.detach().clone() for n, p in first.module.named_parameters()}
    a4 = open(os.path.join(save_dir, "global_step4", "manifest.json")).read()
    comm.barrier(first.mesh.world)
    if rank == 0:
        os.remove(os.path.join(save_dir, "latest"))
        os.makedirs(os.path.join(save_dir, ".global_step6.tmp"))  # a save that never finished
        os.makedirs(os.path.join(save_dir, "global_step8"))  # junk that is no checkpoint
        with open(os.path.join(save_dir, "global_step8", "manifest.json"), "w") as f:
            f.write("{}")
    comm.barrier(first.mesh.world)

    second = engine_and_train(0)
    out["B"] = {
        "resumed_from": second.resumed_from,
        "client": second.resumed_client_state,
        "step": second.global_steps,
        "same weights": all(torch.equal(p, out["A"][n]) for n, p in second.module.named_parameters()),
    }
    comm.barrier(second.mesh.world)
    if rank == 0:
        with open(os.path.join(save_dir, "latest"), "w") as f:
            f.write("global_step2")
    comm.barrier(second.mesh.world)

    third = engine_and_train(2)  # resumes at step 2, saves global_step4 again
    out["C"] = {
        "resumed_from": third.resumed_from,
        "kept": open(os.path.join(save_dir, "global_step4.replaced", "manifest.json")).read() == a4,
        "latest": open(os.path.join(save_dir, "latest")).read(),
    }
    third.save_checkpoint(save_dir)  # this run wrote global_step4: it replaces it, keeping no second copy
    out["C"]["listing"] = sorted(os.listdir(save_dir))
    return out


def test_auto_resume_without_latest_resumes_the_newest_and_never_overwrites(tmp_path):
    """Before: 'latest' deleted -> "no checkpoint yet; starting from step 0", and the first saves overwrote
    global_step2 and global_step4; client_state was dropped on resume and periodic saves carried none."""
    from zeroshard.checkpoint.resume import resume_point

    for out in run_distributed(auto_resume_worker, 2, str(tmp_path)):
        assert out["B"]["resumed_from"].endswith("global_step4") and out["B"]["step"] == 4
        assert out["B"]["same weights"] and out["B"]["client"] == {"step": 4, "note": "periodic"}
        assert out["C"]["resumed_from"].endswith("global_step2")
        assert out["C"]["kept"] and out["C"]["latest"] == "global_step4"  # (the new one equals it: exact resume)
        assert out["C"]["listing"] == [".global_step6.tmp", "global_step2", "global_step4", "global_step4.replaced"] + [
            "global_step8",
            "latest",
        ]
    save_dir = str(tmp_path / "run")
    os.remove(os.path.join(save_dir, "latest"))
    point = resume_point(save_dir)
    assert point.tag == "global_step4" and "'latest' is missing; global_step4 is the newest complete" in point.why


FROZEN = ("blocks.0.ln_1.weight", "blocks.0.fc.weight")
FROZEN_STAGES = ((1, 3), (3, 1), (0, 3), (3, 2), (3, 3))


def _frozen_engine(stage: int):
    import zeroshard

    model = make_model()
    for name, param in model.named_parameters():
        param.requires_grad_(name not in FROZEN)
    case = ParityCase(stage=stage, lr=1e-3, zero=UNITS if stage == 3 else ())
    engine, *_ = zeroshard.initialize(model=model, config=case.config())
    return engine


def frozen_cross_stage_worker(directory: str) -> dict:
    """Frozen parameters are saved among the module's tensors below stage 3 and in frozen flat groups at stage 3;
    either way they load at the other stages (before: a crash into a sharded parameter, or the saved value silently
    not restored)."""
    from zeroshard.zero import GatheredParameters

    out = {}
    for save_stage, load_stage in FROZEN_STAGES:
        where = f"{directory}/{save_stage}-{load_stage}"
        engine = _frozen_engine(save_stage)
        train(engine, range(2), 8)
        frozen = [p for n, p in engine.module.named_parameters() if n in FROZEN]
        with GatheredParameters(frozen, modifier_rank=0):
            for param in frozen:
                param.data.add_(1.0)  # a value no freshly built model has
        saved = engine.consolidated_state_dict(rank0_only=False)
        engine.save_checkpoint(where)
        engine.destroy()
        engine = _frozen_engine(load_stage)
        engine.load_checkpoint(where)
        loaded = engine.consolidated_state_dict(rank0_only=False)
        out[(save_stage, load_stage)] = sorted(n for n in saved if not torch.equal(loaded[n], saved[n]))
        engine.destroy()
    return out


@pytest.mark.parametrize("stages", FROZEN_STAGES, ids=[f"stage{a}-to-stage{b}" for a, b in FROZEN_STAGES])
def test_frozen_parameters_resume_at_every_other_stage(frozen_runs, stages):
    for out in frozen_runs:
        assert out[stages] == [], out[stages]


@pytest.fixture(scope="module")
def frozen_runs(tmp_path_factory):
    return run_distributed(frozen_cross_stage_worker, 2, str(tmp_path_factory.mktemp("frozen")))
