"""The offloaded step during backward (``offload_optimizer.super_offload``, zeroshard/zero/speculation.py): bit for
bit the synchronous step, whatever the verdict.

Each case trains twice in one 2-rank spawn, speculating and not, and compares the weights, every flat group's master
shard, optimizer state and step counters, and the checkpoints saved right after a commit and right after a replay
(every tensor of them). The counters prove which path ran: a case meant to commit commits, one meant to replay
replays."""

import contextlib
import io
import math
import os
import tempfile

import pytest
import torch

from zeroshard.testing import run_distributed
from zeroshard.testing.parity import ParityCase, make_batches, make_model

SWAP = tempfile.gettempdir()
UNITS = (("gather_unit_classes", ["Block"]), ("stage3_param_persistence_threshold", 0))
WHOLE = 10**9


def offload(optimizer, param=None, sub_group=1000, stage=2, host_bytes=None, persistent=False):
    zero = [("sub_group_size", sub_group)] + list(UNITS if stage == 3 else ())
    if persistent:  # every parameter persistent: stage 3 with resident flat groups, as a small model has them
        zero = [("sub_group_size", sub_group), ("stage3_param_persistence_threshold", 10**9)]
    if optimizer == "cpu":
        zero.append(("offload_optimizer", {"device": "cpu", "speculation_host_bytes": host_bytes}))
    else:
        zero.append(("offload_optimizer", {"device": "nvme", "nvme_path": SWAP, "buffer_count": 2}))
    if param == "nvme":
        zero.append(("offload_param", {"device": "nvme", "nvme_path": SWAP, "max_in_cpu": 0, "buffer_count": 3}))
    return tuple(zero)


FP16 = (("fp16", {"enabled": True, "initial_scale_power": 18, "loss_scale_window": 100}),)
WARMUP = (("scheduler", {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3, "warmup_num_steps": 10}}),)
HOST_BYTES = 40_000  # shadows for some of the tiny model's flat groups, not all
NAN_AT = 2  # the NaN case: the loss of this step's first micro-batch on rank 1 is NaN


def case(stage, where, *, clip=0.0, gas=1, dtype="fp32", optimizer="AdamW", param=None, sub_group=1000, extra=(),
         steps=5, params=(), host_bytes=None, persistent=False):  # fmt: skip
    return ParityCase(
        stage, dtype, gas, lr=1e-3, clip=clip, steps=steps, optimizer=optimizer, optimizer_params=params,
        extra=extra, zero=offload(where, param, sub_group, stage, host_bytes, persistent),
    )  # fmt: skip


# name -> (case, what must have happened: "commit" every step, "mixed" both, "replay" at least one, "nan")
CASES = {
    "stage 2, NVMe, no clipping": (case(2, "nvme"), "commit"),
    "stage 2, CPU, clip between the norms, 4 micro-batches, Adam": (
        case(2, "cpu", clip=0.9, gas=4, optimizer="Adam", steps=8), "mixed"),
    "stage 3, NVMe shards their own masters, no clipping, 2 micro-batches": (
        case(3, "nvme", param="nvme", sub_group=WHOLE, gas=2), "commit"),
    "stage 3, NVMe, every parameter persistent, clip between the norms": (
        case(3, "nvme", param="nvme", sub_group=WHOLE, persistent=True, clip=2.0, steps=8), "mixed"),
    "stage 3, NVMe shards their own masters, clip always": (
        case(3, "nvme", param="nvme", sub_group=WHOLE, clip=1e-3), "replay"),
    "stage 3, NVMe shards and bf16, clip between the norms": (
        case(3, "nvme", param="nvme", dtype="bf16", clip=2.0, steps=8), "mixed"),
    "stage 3, CPU, fp16 overflowing, 2 micro-batches": (case(3, "cpu", dtype="fp16", gas=2, extra=FP16, steps=8),
                                                        "mixed"),
    "stage 2, NVMe, a NaN gradient": (case(2, "nvme", steps=4), "nan"),
    "stage 1, CPU, a scheduler every step, Lion": (case(1, "cpu", optimizer="Lion", extra=WARMUP), "commit"),
    "stage 3, NVMe, SGD with momentum, scheduler": (
        case(3, "nvme", optimizer="SGD", params=(("momentum", 0.9),), extra=WARMUP), "commit"),
    "stage 2, CPU, Adagrad, 4 micro-batches": (case(2, "cpu", optimizer="Adagrad", gas=4), "commit"),
    # host shadows bounded below the state: the flat groups that fit are stepped during backward, the rest after
    "stage 3, CPU, shadows bounded, clip between the norms": (
        case(3, "cpu", clip=2.0, steps=8, host_bytes=HOST_BYTES), "bounded"),
}  # fmt: skip


def train(case: ParityCase, speculate: bool, nan: bool, checkpoints: dict, save_at: dict) -> dict:
    """One run; ``save_at``: step -> tag (checkpoints saved right after those steps, into ``checkpoints[tag]``)."""
    import zeroshard
    from zeroshard import comm

    config = case.config()
    config["zero_optimization"]["offload_optimizer"]["super_offload"] = speculate
    config["steps_per_print"] = case.steps  # one report, at the end
    engine, *_ = zeroshard.initialize(model=make_model(), config=config)
    stack = engine.stack
    speculation = stack.optimizer_state.speculation
    assert (speculation is not None) == speculate
    rank, world = comm.get_rank(), comm.get_world_size()
    events, b, log = [], case.micro_batch, io.StringIO()
    for step, (x, y) in enumerate(make_batches(case.steps, world * b * case.gas), start=1):
        for k in range(case.gas):
            rows = slice((k * world + rank) * b, (k * world + rank + 1) * b)
            loss = engine(x[rows], y[rows])
            if nan and step == NAN_AT and k == 0 and rank == 1:
                loss = loss * math.nan
            engine.backward(loss)
            with contextlib.redirect_stdout(log):
                engine.step()
        if speculation is not None:
            s = speculation.stats
            events.append((s.last_speculated, s.last_committed, s.last_replayed, s.last_replay_bytes))
        if step in save_at:
            engine.save_checkpoint(checkpoints[save_at[step]], tag="t")
    state = [
        ({k: v.clone() for k, v in stack.read_flat(i).items()}, _scalars(stack.flat_scalars(i)))
        for i in range(len(stack.flat_groups))
    ]
    out = {
        "params": {k: v.float() for k, v in engine.consolidated_state_dict(rank0_only=False).items()},
        "state": state,
        "events": events,
        "skipped": engine.skipped_steps,
        "stats": speculation.stats if speculation is not None else None,
        "subgroups": len(stack.optimizer_state.subgroups),
        "shadow_bytes": getattr(stack.optimizer_state, "shadow_bytes", 0),
        "io": engine.disk_io(),
        "log": log.getvalue(),
    }
    engine.destroy()
    return out


def _scalars(scalars: dict) -> dict:
    return {k: v.item() if torch.is_tensor(v) else v for k, v in scalars.items()}


def _checkpoint_tensors(directory: str) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for root, _, files in os.walk(directory):
        for name in sorted(files):
            if name.endswith(".safetensors"):
                for key, value in load_file(os.path.join(root, name)).items():
                    tensors[f"{os.path.relpath(os.path.join(root, name), directory)}:{key}"] = value
    return tensors


def speculation_worker(names: list[str], directory: str) -> dict:
    from zeroshard import comm

    results = {}
    for name in names:
        case_, expect = CASES[name]
        nan = expect == "nan"
        dirs = {
            tag: os.path.join(directory, f"{len(results)}-{tag}")
            for tag in ("spec-commit", "spec-replay", "sync-commit", "sync-replay")
        }
        speculated = train(case_, True, nan, dirs, {})
        # checkpoints right after the first commit and the first replay, in both runs
        first = {}
        for step, (_, committed, replayed, _) in enumerate(speculated["events"], start=1):
            first.setdefault("commit", step) if committed else None
            first.setdefault("replay", step) if replayed else None
        save_at = {step: kind for kind, step in first.items()}
        speculated = train(case_, True, nan, {k: dirs[f"spec-{k}"] for k in ("commit", "replay")}, save_at)
        synchronous = train(case_, False, nan, {k: dirs[f"sync-{k}"] for k in ("commit", "replay")}, save_at)
        comm.barrier(comm.world_group())
        saved = {kind: (_checkpoint_tensors(dirs[f"spec-{kind}"]), _checkpoint_tensors(dirs[f"sync-{kind}"]))
                 for kind in first}  # fmt: skip
        results[name] = (speculated, synchronous, saved)
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("speculation"))
    return run_distributed(speculation_worker, 2, list(CASES), directory, timeout_s=600)


@pytest.mark.parametrize("name", list(CASES))
def test_the_step_during_backward_is_the_synchronous_step_bit_for_bit(runs, name):
    expect = CASES[name][1]
    for rank, rank_results in enumerate(runs):
        speculated, synchronous, saved = rank_results[name]
        assert speculated["skipped"] == synchronous["skipped"]
        for key, value in synchronous["params"].items():
            assert torch.equal(speculated["params"][key], value), (name, key)
        for (tensors, scalars), (expected, expected_scalars) in zip(speculated["state"], synchronous["state"]):
            assert tensors.keys() == expected.keys() and scalars == expected_scalars, name
            for key, value in expected.items():
                assert torch.equal(tensors[key], value), (name, key)
        for kind, (spec, sync) in saved.items():
            assert spec.keys() == sync.keys() and spec, (name, kind)
            for key, value in sync.items():
                assert torch.equal(spec[key], value), (name, kind, key)
        stats, events = speculated["stats"], speculated["events"]
        commits = sum(1 for e in events if e[1])
        replays = sum(1 for e in events if e[2])
        assert stats.speculated == stats.committed + stats.replayed
        if rank == 0:  # the report every steps_per_print steps says the same
            line = f"{stats.speculated} sub-groups speculated in {len(events)} steps, {stats.committed} committed, "
            assert f"optimizer step during backward (rank 0): {line}" in speculated["log"], speculated["log"]
        counts = speculated["io"]  # engine.disk_io() reports the same counts
        assert (counts["speculated"], counts["committed"], counts["replayed"]) == (
            stats.speculated,
            stats.committed,
            stats.replayed,
        )
        assert counts["replay_bytes"] == stats.replay_bytes and counts["speculation_wait_s"] >= 0
        assert all(e[3] > 0 for e in events if e[2]) and all(e[3] == 0 for e in events if not e[2])
        if expect == "commit":  # clipping never clips: every step committed, nothing replayed
            assert commits == len(events) and stats.replayed == 0 and stats.replay_bytes == 0, events
            assert set(saved) == {"commit"}
        if expect == "mixed":
            assert commits and replays and set(saved) == {"commit", "replay"}, events
        if expect == "replay":  # clipping on every step: three replays, then the policy stops speculating
            assert replays == 3 and commits == 0 and all(e[2] for e in events[:3]), events
            assert not any(e[0] for e in events[3:]), events
        if expect == "bounded":
            assert speculated["shadow_bytes"] <= HOST_BYTES and commits, events
            assert all(0 < e[0] < speculated["subgroups"] for e in events if e[0]), events
        if expect == "nan":  # the NaN step is skipped, its speculation replayed (skipped as the synchronous one)
            assert speculated["skipped"] == 1 and events[NAN_AT - 1][2] and commits, events


KILLED_BEFORE_COMMIT = """
import os, signal, sys, torch, zeroshard
from zeroshard.testing.parity import ParityCase, make_model
swap, checkpoint = sys.argv[1], sys.argv[2]
nvme = {"device": "nvme", "nvme_path": swap}
zero = (("stage3_param_persistence_threshold", 0), ("sub_group_size", 700))
zero += (("offload_param", {**nvme, "max_in_cpu": 0}),)
x = torch.randint(0, 64, (2, 8))

def engine_with(speculate):
    optimizer = {**nvme, "super_offload": speculate}
    case = ParityCase(stage=3, lr=1e-3, micro_batch=2, zero=zero + (("offload_optimizer", optimizer),))
    engine, *_ = zeroshard.initialize(model=make_model(), config=case.config())
    engine.backward(engine(x, x))
    engine.step()
    return engine

def state(engine):
    flats = [engine.stack.read_flat(i) for i in range(len(engine.stack.flat_groups))]
    return engine.consolidated_state_dict(rank0_only=False), flats

synchronous = engine_with(False)  # one step, the step after backward
torch.save(state(synchronous), os.path.join(swap, "..", "expected.pt"))
synchronous.destroy()
engine = engine_with(True)
engine.backward(engine(x, x))  # the second step is stepped into the shadows during this backward
engine.stack.optimizer_state.settle()
assert engine.stack.optimizer_state.speculation.armed  # speculated, not yet committed
engine.save_checkpoint(checkpoint)  # between the speculation and its commit: the state of one step
os.kill(os.getpid(), signal.SIGKILL)
"""

RELOAD = """
import os, sys, torch, zeroshard
from zeroshard.testing.parity import ParityCase, make_model
checkpoint = sys.argv[1]
case = ParityCase(stage=3, lr=1e-3, micro_batch=2, zero=(("stage3_param_persistence_threshold", 0),))
engine, *_ = zeroshard.initialize(model=make_model(seed=3), config=case.config())
engine.load_checkpoint(checkpoint)
params, flats = torch.load(os.path.join(checkpoint, "..", "expected.pt"))
got = engine.consolidated_state_dict(rank0_only=False)
same = all(torch.equal(got[k], v) for k, v in params.items())
for i, expected in enumerate(flats):
    loaded = engine.stack.read_flat(i)
    same = same and all(torch.equal(loaded[k], v) for k, v in expected.items())
print("EQUAL", same)
"""


def test_sigkill_between_a_speculation_and_its_commit_resumes_from_the_committed_state(tmp_path):
    """A checkpoint saved after a backward that speculated the step, then SIGKILL before ``engine.step()``: the
    checkpoint holds the state before that step (equal, master weights and moments included, to a run that never
    speculated), never the shadows, and loads into a fresh run without offload."""
    import signal
    import subprocess
    import sys

    swap, checkpoint = tmp_path / "swap", tmp_path / "checkpoint"
    swap.mkdir()
    env = {**os.environ, "ZEROSHARD_ACCELERATOR": "cpu"}
    killed = subprocess.run([sys.executable, "-c", KILLED_BEFORE_COMMIT, str(swap), str(checkpoint)], env=env,
                            capture_output=True, timeout=300)  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert os.listdir(swap) == []  # the swap files (shadows included) went with the process
    reloaded = subprocess.run([sys.executable, "-c", RELOAD, str(checkpoint)], env=env, capture_output=True,
                              text=True, timeout=300)  # fmt: skip
    assert "EQUAL True" in reloaded.stdout, reloaded.stderr[-2000:]


def replay_failure_worker(checkpoint_dir: str):
    """The disk loses the swap file's contents after a speculation that must replay (clipping on every step): the
    replay's first read fails by name, and the checkpoint saved before loads into a fresh run, equal."""
    import zeroshard
    from zeroshard.offload import OffloadIOError

    config = case(2, "nvme", clip=1e-3).config()
    config["zero_optimization"]["offload_optimizer"]["super_offload"] = True
    engine, *_ = zeroshard.initialize(model=make_model(), config=config)
    x = torch.randint(0, 64, (2, 8))
    engine.backward(engine(x, x))
    engine.step()
    engine.save_checkpoint(checkpoint_dir)
    saved = engine.consolidated_state_dict(rank0_only=False)
    speculation = engine.stack.optimizer_state.speculation
    while not speculation.policy.speculating:  # the replay above paused it; let it speculate the next step
        speculation.policy.record(False, True)
    engine.backward(engine(x, x))
    engine.stack.optimizer_state.settle()
    os.ftruncate(engine.stack.optimizer_state.swapper.file.fd, 0)  # after the shadows were written
    try:
        engine.step()  # clipped: the speculation is discarded and the step replayed from the (lost) state
        failure = None
    except OffloadIOError as error:
        failure = str(error)
    replayed = speculation.stats.last_replayed
    fresh, *_ = zeroshard.initialize(model=make_model(seed=5), config=config)
    fresh.load_checkpoint(checkpoint_dir)
    restored = fresh.consolidated_state_dict(rank0_only=False)
    return failure, replayed, all(torch.equal(saved[k], restored[k]) for k in saved)


def test_a_disk_fault_mid_replay_is_named_and_the_checkpoint_loads(tmp_path):
    for failure, replayed, restored in run_distributed(replay_failure_worker, 2, str(tmp_path)):
        assert replayed > 0 and failure is not None and "swap file" in failure and "truncated" in failure
        assert restored


def disk_room_worker(directory: str) -> list:
    """With and without the step during backward, on a disk with room for one copy of the optimizer state only."""
    import zeroshard
    from zeroshard.offload import OffloadIOError

    results = []
    for speculate in (True, False):
        nvme = {"device": "nvme", "nvme_path": directory, "super_offload": speculate}
        config = ParityCase(stage=2, lr=1e-3, zero=(("offload_optimizer", nvme),)).config()
        try:
            engine, *_ = zeroshard.initialize(model=make_model(), config=config)
            x = torch.randint(0, 64, (2, 8))
            engine.backward(engine(x, x))
            engine.step()
            engine.destroy()
            results.append(None)
        except OffloadIOError as error:
            results.append(str(error))
    return results


def test_a_disk_too_small_for_the_twins_is_refused_at_initialize_with_the_bytes(tmp_path):
    """400 KiB of disk: one rank's optimizer state takes 336 KiB after its first step (112 KiB of master weights and
    gradients reserved at initialize, the moments with the first step); the twins would take 672 KiB. With the step
    during backward, initialize refuses, naming the bytes it needs; without it, training runs."""
    from .test_offload import small_tmpfs

    disk = tmp_path / "disk"
    small_tmpfs(disk, "size=400k")
    try:
        speculating, synchronous = run_distributed(disk_room_worker, 1, str(disk))[0]
        assert synchronous is None
        assert speculating is not None and "needs 458752 more bytes" in speculating and "super_offload" in speculating
    finally:
        import subprocess

        subprocess.run(["umount", str(disk)], capture_output=True)


def client_optimizer_worker() -> list:
    """A client's optimizer object with a torch LR scheduler bound to it before ``initialize`` (Accelerate's and the
    HF Trainer's order): zeroshard steps that object over the master shards. Before: probing it for its state
    tensors (the NVMe disk check) re-pointed its groups at the probe, and nothing trained."""
    import zeroshard
    from zeroshard.ops.adam import CPUAdam

    out = []
    for speculate in (True, False):
        model = make_model()
        optimizer = CPUAdam(model.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        nvme = {"device": "nvme", "nvme_path": SWAP, "super_offload": speculate}
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
                  "zero_optimization": {"stage": 3, "offload_optimizer": nvme, **dict(UNITS)}}  # fmt: skip
        engine, *_ = zeroshard.initialize(model=model, optimizer=optimizer, config=config)
        numels = sorted(p.numel() for group in optimizer.param_groups for p in group["params"])
        x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
        for _ in range(3):
            engine.backward(engine(x, x))
            engine.step()
            scheduler.step()
        stats = engine.stack.optimizer_state.speculation.stats if speculate else None
        params = {k: v.clone() for k, v in engine.consolidated_state_dict(rank0_only=False).items()}
        out.append((params, numels, stats.committed if stats else None))
        engine.destroy()
    return out


def test_a_client_optimizer_with_its_scheduler_speculates_exactly():
    for (spec, numels, committed), (sync, sync_numels, _) in run_distributed(client_optimizer_worker, 2):
        assert numels == sync_numels and 64 not in numels and committed > 0
        for key, value in sync.items():
            assert torch.equal(spec[key], value), key
