"""Offload: parity with the same config without offload (bit-identical: the math is the same, only
where it runs changes), model-state bytes by location against the analytic values, bounded host
memory for NVMe state, swap files left behind (none), and the errors for unusable NVMe paths."""

import dataclasses
import os
import signal
import subprocess
import sys
import tempfile

import pytest
import torch

from zeroshard.offload.aio import align_up
from zeroshard.testing import run_distributed
from zeroshard.testing.parity import (
    ParityCase,
    engine_train,
    engine_train_many,
    make_batches,
    make_model,
    model_error,
    reference_train,
)

SWAP = tempfile.gettempdir()  # swap files are unlinked as soon as they are opened, so nothing accumulates
UNITS = (("gather_unit_classes", ["Block"]), ("stage3_param_persistence_threshold", 0))
SUB_GROUP = 1000  # small, so every flat group is several sub-groups and the NVMe pipeline cycles its buffers
NVME_BUFFERS = 2
WHOLE = 10**9  # DeepSpeed's default sub_group_size: every shard one sub-group


def offload(optimizer=None, param=None, sub_group=SUB_GROUP):
    zero = [("sub_group_size", sub_group)]
    if optimizer == "cpu":
        zero.append(("offload_optimizer", {"device": "cpu", "pin_memory": True}))
    if optimizer == "nvme":
        zero.append(("offload_optimizer", {"device": "nvme", "nvme_path": SWAP, "buffer_count": NVME_BUFFERS}))
    if param == "cpu":
        zero.append(("offload_param", {"device": "cpu"}))
    if param == "nvme":  # every shard on NVMe, read through 3 buffers
        zero.append(("offload_param", {"device": "nvme", "nvme_path": SWAP, "max_in_cpu": 0, "buffer_count": 3}))
    return tuple(zero)


VARIANTS = {
    1: [(None, None), ("cpu", None), ("nvme", None)],
    2: [(None, None), ("cpu", None), ("nvme", None)],
    3: [
        (None, None),
        ("cpu", None),
        ("nvme", None),
        ("cpu", "cpu"),
        ("nvme", "nvme"),
        (None, "nvme"),
        ("nvme", "nvme", WHOLE),  # one sub-group per shard: an fp32 shard is its own master on disk
    ],
}


# fp16 starting at a loss scale of 2^24: the first steps overflow and are skipped, then the scale has come down
OVERFLOWING = (("fp16", {"enabled": True, "initial_scale_power": 24, "loss_scale_window": 2}),)


def cases(stage, dtype="fp32", clip=0.0):
    units = UNITS if stage == 3 else ()
    extra = OVERFLOWING if dtype == "fp16" else ()
    steps = 12 if dtype == "fp16" else 3
    return [
        ParityCase(stage, dtype, 2, lr=1e-3, clip=clip, steps=steps, extra=extra, zero=units + offload(*variant))
        for variant in VARIANTS[stage]
    ]


@pytest.mark.parametrize(
    "stage,dtype,clip",
    [
        (1, "fp32", 0.0),
        (2, "fp32", 0.0),
        (2, "bf16", 0.05),
        (2, "fp16", 0.05),
        (3, "fp32", 0.0),
        (3, "bf16", 0.05),
        (3, "fp16", 0.05),
    ],
)
def test_offload_matches_the_same_run_without_offload(stage, dtype, clip):
    """Bit for bit, with gradient accumulation (2 micro-batches), clipping that clips (0.05) and fp16 steps that
    overflow and are skipped: the NVMe optimizer's gradients wait on disk until the verdict and are read back
    with their sub-groups, and the result is the same as with them in memory."""
    runs = cases(stage, dtype, clip)
    results = run_distributed(engine_train_many, 2, runs)[0]
    baseline = results[0]
    if dtype == "fp32" and clip == 0.0:
        assert model_error(baseline["params"], reference_train(runs[0], 2)) <= 1e-5
    if dtype == "fp16":
        assert 0 < baseline["skipped_steps"] < baseline["global_steps"]  # some skipped, some applied
    for variant, result in zip(VARIANTS[stage][1:], results[1:]):
        assert result["skipped_steps"] == baseline["skipped_steps"], variant
        for name, value in baseline["params"].items():
            assert torch.equal(result["params"][name], value), (variant, name)
        check_memory(variant, result, dtype)


@pytest.mark.parametrize("stage", [2, 3])
def test_lamb_with_the_optimizer_state_in_host_memory_is_lamb_on_the_device(stage):
    """Before: refused. Each flat group's shard is one sub-group (sub_group_size's default), so the optimizer
    contract's layout completes each parameter's norms as on the device: bit for bit (a sub-group that cuts a shard
    is refused: test_unusable_offload_settings_...)."""
    units = UNITS if stage == 3 else ()
    runs = [ParityCase(stage, "fp32", 2, lr=1e-3, optimizer="Lamb", zero=units + offload(*variant, sub_group=WHOLE))
            for variant in ((None, None), ("cpu", None))]  # fmt: skip
    device, host = run_distributed(engine_train_many, 2, runs)[0]
    assert host["state_bytes_by_location"]["host"]["optimizer_state"] > 0
    for name, value in device["params"].items():
        assert torch.equal(host["params"][name], value), name


def check_memory(variant, result, dtype):
    """Model-state bytes per location, from the tensors the engine holds, against the analytic split."""
    optimizer, param, *sub_group = variant
    shared = sub_group == [WHOLE] and param == "nvme" and dtype == "fp32"  # the shard is the master
    where = result["state_bytes_by_location"]
    shard = sum(numel for numel, resident in result["flat_numels"]) // 2  # elements this rank owns
    compute = 4 if dtype == "fp32" else 2
    device, host, nvme = where["device"], where["host"], where["nvme"]
    if optimizer is not None:  # nothing of the optimizer side stays on the device
        assert device["master"] == device["grad_shard"] == device["optimizer_state"] == 0
    if optimizer == "cpu" or (optimizer == "nvme" and param != "nvme"):  # with the parameter shards: in RAM
        assert host["grad_shard"] in (4 * shard, compute * shard)  # stage-3 gradient shards: compute dtype
    if optimizer == "cpu":
        assert host["master"] == 4 * shard and host["optimizer_state"] == 8 * shard  # fp32 master, Adam m and v
    if optimizer == "nvme":
        # the step during backward (on by default with NVMe) writes a twin of the master and of each moment: the
        # shared master's twin is in the optimizer's file
        assert nvme["master"] == (4 * shard if shared else 8 * shard) and nvme["optimizer_state"] == 16 * shard
        if param == "nvme":  # with the parameter shards: on disk, in fp32
            assert host["grad_shard"] == 0 and nvme["grad_shard"] == 4 * shard
        # host copies of NVMe state: at most buffer_count staging buffers of one sub-group (master, m, v, gradient);
        # gradients on disk add the training thread's two slots and buffer_count + 1 hand-off buffers while the step
        # runs during backward
        assert host["master"] == 0
        largest = max(n for n, _ in result["flat_numels"]) // 2
        sub = min((sub_group or [SUB_GROUP])[0], largest)
        spilled = 2 + NVME_BUFFERS + 1 if param == "nvme" else 0
        assert host["optimizer_state"] <= (NVME_BUFFERS * 4 + spilled) * align_up(sub * 4)
    if param == "cpu":
        assert device["params"] == 0 and host["params"] == compute * shard  # only gathered units on device
    if param == "nvme":
        assert device["params"] == 0 and nvme["params"] == compute * shard
        assert host["params"] <= 3 * align_up(max(n for n, _ in result["flat_numels"]) // 2 * compute)
    assert device["gathered"] == 0  # between steps nothing stays gathered


def swap_hygiene_worker(swap_dir):
    """Swap files never show up in nvme_path (unlinked at once), training works with a 1-buffer pipeline, the disk
    ledger is exact, and two engines on one nvme_path keep apart."""
    import zeroshard
    from zeroshard import comm

    case = ParityCase(
        stage=3,
        lr=1e-3,
        zero=UNITS
        + (
            ("sub_group_size", 700),
            # the step after backward: the ledger below is exact (with the step during backward, gradients handed
            # off in memory are not read back, as many as its lag allows: the second run)
            ("offload_optimizer", {"device": "nvme", "nvme_path": swap_dir, "buffer_count": 1, "super_offload": False}),
            ("offload_param", {"device": "nvme", "nvme_path": swap_dir, "max_in_cpu": 0, "buffer_count": 1}),
        ),
    )
    engine, *_ = zeroshard.initialize(model=make_model(), config=case.config())
    listed = os.listdir(swap_dir)
    x = torch.randint(0, 64, (2, 8))
    moved = []  # bytes the swap files read and wrote in each step
    for _ in range(3):
        before = engine.disk_io()
        engine.backward(engine(x, x))
        engine.step()
        after = engine.disk_io()
        moved.append((after["read"] - before["read"], after["written"] - before["written"]))
    predicted = zeroshard.estimate(make_model, case.config(), world_size=2).disk_per_step
    stack = engine.stack
    state = sum(align_up(sub.numel * 4) for sub in stack.optimizer_state.subgroups)  # one key of every sub-group
    shards = [align_up(flat.layout.shard_numel * 4) for flat in stack.flat_groups]  # units', then the root's
    # a modification through GatheredParameters reaches the NVMe-resident parameter shard and master weights
    weight = engine.module.blocks[1].fc.weight
    with zeroshard.zero.GatheredParameters([weight], modifier_rank=0):
        if comm.get_rank() == 0:
            weight.data.fill_(0.5)
    flat = next(k for k, f in enumerate(engine.stack.flat_groups) if any(p is weight for p in f.params))
    masters = engine.stack.read_flat(flat)["master"]
    comm.barrier(engine.mesh.world)
    params = engine.consolidated_state_dict(rank0_only=False)
    # a second run pointing at the same nvme_path (here: in the same process) has swap files of its own; its
    # sub-groups are whole shards, so its fp32 shards are their own masters: its disk bytes as estimate predicts
    whole = dataclasses.replace(case, zero=tuple(kv for kv in case.zero if kv[0] != "sub_group_size"))
    other, *_ = zeroshard.initialize(model=make_model(seed=7), config=whole.config())
    for _ in range(2):
        before = other.disk_io()
        other.backward(other(x, x))
        other.step()
    after = other.disk_io()
    shared = (after["read"] - before["read"], after["written"] - before["written"])
    shared_predicted = zeroshard.estimate(make_model, whole.config(), world_size=2).disk_per_step
    untouched = engine.consolidated_state_dict(rank0_only=False)
    independent = all(torch.equal(untouched[k], v) for k, v in params.items())
    result = listed, engine.stack.optimizer_state.swapper.bytes_on_disk(), params, masters, (moved, state, shards)
    return (*result, independent, predicted, (shared, shared_predicted))


def test_swap_files_leave_nothing_behind(tmp_path):
    results = run_distributed(swap_hygiene_worker, 2, str(tmp_path))
    for *_, (moved, state, shards), independent, predicted, (shared, shared_predicted) in results:
        assert independent  # another engine on the same nvme_path changed nothing of this one's state
        assert (predicted["read"], predicted["written"]) == moved[1]  # zeroshard estimate's disk bytes per step
        # the second run steps during backward (the default): estimate's read bytes are the most it reads, less
        # at most its gradients, each handed off in memory rather than read back
        grads = sum(shards)  # one gradient region per flat group there (whole-shard sub-groups), as large
        assert shared_predicted["written"] == shared[1]
        assert shared_predicted["read"] - grads <= shared[0] <= shared_predicted["read"], (shared, shared_predicted)
        assert shared[1] < moved[1][1]  # the parameter shards were not written a second time
        # the disk ledger, exactly: the step reads master, exp_avg, exp_avg_sq and the gradient of every sub-group
        # and writes the first three back, backward wrote the gradient; each unit's parameter shard is read for
        # its forward and again for its backward, the root unit's once (gathered throughout), and from the second
        # step on the last block's once (kept from its forward into its backward); all are written after the step.
        # The first step has no moments to read yet.
        params_read = 2 * sum(shards[:-1]) + shards[-1]
        assert moved[0] == (2 * state + params_read, 4 * state + sum(shards))
        assert moved[1] == moved[2] == (4 * state + params_read - shards[-2], 4 * state + sum(shards))
    for listed, on_disk, params, *_ in results:
        assert listed == [] and on_disk > 0
        assert all(torch.isfinite(v).all() for v in params.values())
        assert (params["blocks.1.fc.weight"] == 0.5).all()
    # the ranks' master shards on NVMe together hold the whole modified weight
    assert sum(int((r[3] == 0.5).sum()) for r in results) == params["blocks.1.fc.weight"].numel()
    assert os.listdir(tmp_path) == []


def config_error_worker(zero, optimizer="AdamW"):
    import zeroshard

    case = ParityCase(stage=zero.get("stage", 2), optimizer=optimizer, zero=tuple(zero.items()))
    try:
        zeroshard.initialize(model=make_model(), config=case.config())
    except Exception as error:  # the test inspects the type and message
        return type(error).__name__, str(error)
    return None


NVME = {"device": "nvme", "nvme_path": SWAP}
BAD = [
    ({"offload_optimizer": {"device": "nvme", "nvme_path": "/no/such/dir"}}, "AdamW", "does not exist"),
    ({"offload_optimizer": {"device": "nvme", "nvme_path": "/proc"}}, "AdamW", "cannot create swap file"),
    ({"offload_optimizer": {"device": "nvme"}}, "AdamW", "nvme_path"),
    ({"stage": 0, "offload_optimizer": {"device": "cpu"}}, "AdamW", "set stage to 1, 2 or 3"),
    ({"offload_optimizer": {"device": "cpu"}, "sub_group_size": 16}, "Lamb", "sub_group_size"),
    ({"offload_optimizer": NVME}, "Adagrad", "creates its state when constructed"),
    ({"offload_optimizer": {"device": "cpu", "ratio": 1.5}}, "AdamW", "zero_optimization.offload_optimizer.ratio"),
    (
        {"offload_optimizer": {"device": "cpu", "ratio": "auto", "keep_on_device_bytes": 0}},
        "AdamW",
        "keeps none of the optimizer state",
    ),
    # the step during backward needs an elementwise optimizer (Lamb's trust ratio reads whole parameters)
    ({"offload_optimizer": {"device": "cpu", "super_offload": True}}, "Lamb", "super_offload with Lamb"),
    (
        {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "offload_param": {**NVME, "max_in_cpu": 0, "buffer_size": 10},
        },
        "AdamW",
        "offload_param.buffer_size",
    ),
]


def config_errors_worker(settings):
    return [config_error_worker(zero, optimizer) for zero, optimizer, _ in settings]


def test_unusable_offload_settings_fail_at_initialize_naming_the_key():
    for (zero, _, message), got in zip(BAD, run_distributed(config_errors_worker, 1, BAD)[0]):
        assert got is not None and message in got[1], (zero, got)


def small_tmpfs(path, options):
    os.makedirs(path, exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root); the RLIMIT_FSIZE test in tests/unit/offload covers it")


def test_full_or_read_only_disk_is_a_clear_error(tmp_path):
    """A 16 KiB tmpfs as nvme_path: the swap space is claimed at initialize, which fails with ENOSPC;
    a read-only mount fails when the swap file is created."""
    full, read_only = tmp_path / "full", tmp_path / "read-only"
    small_tmpfs(full, "size=16k")
    small_tmpfs(read_only, "size=1m,ro")
    try:
        settings = [
            ({"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": str(path)}}, "AdamW", None)
            for path in (full, read_only)
        ]
        (name, message), (ro_name, ro_message) = run_distributed(config_errors_worker, 1, settings)[0]
        assert name == "OffloadIOError" and "disk is full" in message and str(full) in message, message
        assert ro_name == "OffloadIOError" and "Read-only file system" in ro_message, ro_message
    finally:
        for path in (full, read_only):
            subprocess.run(["umount", str(path)], capture_output=True)


def io_failure_worker(checkpoint_dir):
    """Train, checkpoint, lose the swap file's contents mid-run: the step fails clearly and the last
    checkpoint still loads."""
    import zeroshard
    from zeroshard.offload import OffloadIOError

    cfg = ParityCase(stage=2, lr=1e-3, zero=offload("nvme")).config()
    engine, *_ = zeroshard.initialize(model=make_model(), config=cfg)
    x = torch.randint(0, 64, (2, 8))
    engine.backward(engine(x, x))
    engine.step()
    engine.save_checkpoint(checkpoint_dir)
    saved = engine.consolidated_state_dict(rank0_only=False)
    os.ftruncate(engine.stack.optimizer_state.swapper.file.fd, 0)  # the swap file loses its contents
    engine.backward(engine(x, x))
    try:
        engine.step()
        failure = None
    except OffloadIOError as error:
        failure = str(error)
    fresh, *_ = zeroshard.initialize(model=make_model(seed=5), config=cfg)
    fresh.load_checkpoint(checkpoint_dir)
    restored = fresh.consolidated_state_dict(rank0_only=False)
    return failure, all(torch.equal(saved[k], restored[k]) for k in saved)


def test_swap_io_failure_stops_training_and_keeps_the_checkpoint(tmp_path):
    for failure, restored in run_distributed(io_failure_worker, 2, str(tmp_path)):
        assert failure is not None and "swap file" in failure and "truncated" in failure
        assert restored


def garbage_worker() -> dict:
    """4 KiB of garbage in a swap file between two steps (stage 2: the optimizer's; stage 3: the parameter shards'):
    the next read names it, where before it trained on as NaN without a word; with aio.verify_reads off it still
    does (the control)."""
    import zeroshard
    from zeroshard.offload import SwapChecksumError

    out = {}
    for name, stage, zero, verify in (
        ("optimizer", 2, offload("nvme"), True),
        ("params", 3, UNITS + offload("nvme", "nvme"), True),
        ("unchecked", 2, offload("nvme"), False),
    ):
        cfg = ParityCase(stage=stage, lr=1e-3, zero=zero).config()
        cfg["aio"] = {"verify_reads": verify}
        engine, *_ = zeroshard.initialize(model=make_model(), config=cfg)
        x = torch.randint(0, 64, (2, 8))
        engine.backward(engine(x, x))
        engine.step()
        engine.stack.settle()
        home = engine.stack.shard_homes if name == "params" else engine.stack.optimizer_state.swapper
        offset = 8192
        if name != "params":  # a region the next step reads (steps during backward alternate between two)
            first = engine.stack.optimizer_state.subgroups[0]
            offset = home.regions[(id(first.param), "master")][1]
        fd = os.open(f"/proc/self/fd/{home.file.fd}", os.O_RDWR)  # the unlinked swap file, written beside zeroshard
        os.pwrite(fd, os.urandom(4096), offset)
        os.close(fd)
        try:
            for _ in range(2):
                engine.backward(engine(x, x))
                engine.step()
            engine.stack.settle()
            out[name] = "no error"
        except SwapChecksumError as error:
            out[name] = str(error)
    return out


def test_garbage_in_a_swap_file_is_named_at_its_next_read():
    for result in run_distributed(garbage_worker, 2):
        for name in ("optimizer", "params"):
            assert "the bytes read back differ from those written there" in result[name], (name, result[name])
            assert "swap file" in result[name] and "resume from the last checkpoint" in result[name]
        assert result["unchecked"] == "no error"


KILLED_MID_WRITE = """
import os, signal, sys, torch, zeroshard
from zeroshard.testing.parity import ParityCase, make_model
swap, checkpoint = sys.argv[1], sys.argv[2]
nvme = {"device": "nvme", "nvme_path": swap}
zero = (("sub_group_size", 700), ("offload_optimizer", nvme), ("offload_param", {**nvme, "max_in_cpu": 0}))
case = ParityCase(stage=3, lr=1e-3, micro_batch=2, zero=(("stage3_param_persistence_threshold", 0),) + zero)
engine, *_ = zeroshard.initialize(model=make_model(), config=case.config())
x = torch.randint(0, 64, (2, 8))
engine.backward(engine(x, x))
engine.step()
engine.save_checkpoint(checkpoint)
torch.save(engine.consolidated_state_dict(rank0_only=False), os.path.join(checkpoint, "expected.pt"))
swapper = engine.stack.optimizer_state.swapper
write_grad = swapper.write_grad
def write_then_die(sub, values, final=False):  # SIGKILL right after a gradient write was submitted behind
    write_grad(sub, values, final)
    os.kill(os.getpid(), signal.SIGKILL)
swapper.write_grad = write_then_die
engine.backward(engine(x, x))
"""

RELOAD = """
import os, sys, torch, zeroshard
from zeroshard.testing.parity import ParityCase, make_model
checkpoint = sys.argv[1]
case = ParityCase(stage=3, lr=1e-3, micro_batch=2, zero=(("stage3_param_persistence_threshold", 0),))
engine, *_ = zeroshard.initialize(model=make_model(seed=3), config=case.config())
engine.load_checkpoint(checkpoint)
got = engine.consolidated_state_dict(rank0_only=False)
expected = torch.load(os.path.join(checkpoint, "expected.pt"))
print("EQUAL", all(torch.equal(got[k], v) for k, v in expected.items()))
"""


def test_sigkill_during_a_write_behind_leaves_nothing_and_the_checkpoint_loads(tmp_path):
    """A rank killed while a gradient write is in flight: its swap files vanish with it (they were unlinked when
    opened) and the last checkpoint loads into a fresh run, without offload, equal to what was saved."""
    swap, checkpoint = tmp_path / "swap", tmp_path / "checkpoint"
    swap.mkdir()
    env = {**os.environ, "ZEROSHARD_ACCELERATOR": "cpu"}
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_MID_WRITE, str(swap), str(checkpoint)], env=env, capture_output=True, timeout=300
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert os.listdir(swap) == []
    reloaded = subprocess.run(
        [sys.executable, "-c", RELOAD, str(checkpoint)], env=env, capture_output=True, text=True, timeout=300
    )
    assert "EQUAL True" in reloaded.stdout, reloaded.stderr[-2000:]


STEP_BEHIND = {
    "optimizer on NVMe": (("sub_group_size", 700), ("offload_optimizer", {"device": "nvme", "nvme_path": SWAP})),
    "optimizer and shards on NVMe": (("sub_group_size", 700),) + offload("nvme", "nvme")[1:],
    "shards on NVMe, each its own master": (("sub_group_size", WHOLE),) + offload("nvme", "nvme")[1:],
}


def step_behind_worker(scheduler):
    """Stage 3 with the optimizer on NVMe (and the parameter shards too): the step runs behind the next forward.
    Each step's last sub-group is held (a step pre-hook, torch's own) until the next forward has entered the first
    block, which proves that forward ran while the step did; the weights are returned for the bitwise comparison
    with the synchronous run."""
    from zeroshard import comm

    rank, world = comm.get_rank(), comm.get_world_size()
    runs = {name: run_behind(scheduler, UNITS + zero, rank, world) for name, zero in STEP_BEHIND.items()}
    synchronous = engine_train(ParityCase(stage=3, lr=1e-3, gas=2, clip=0.05, steps=4, zero=UNITS, extra=scheduler))
    return runs, synchronous["params"]


def run_behind(scheduler, zero, rank, world):
    import threading

    import zeroshard

    case = ParityCase(stage=3, lr=1e-3, gas=2, clip=0.05, steps=4, zero=zero, extra=scheduler)
    config = case.config()
    config["zero_optimization"]["offload_optimizer"]["super_offload"] = False  # the step after backward, behind
    engine, *_ = zeroshard.initialize(model=make_model(), config=config)
    assert engine.stack.steps_behind
    state = engine.stack.optimizer_state
    first_block = threading.Event()
    engine.module.blocks[0].register_forward_pre_hook(lambda *_: first_block.set())  # after the gather's own hook
    held, stepped = [], [0]

    def hold_the_last_sub_group(optimizer, args, kwargs):
        stepped[0] += 1
        if stepped[0] % len(state.subgroups) == 0 and stepped[0] < (case.steps - 1) * len(state.subgroups) + 1:
            held.append(first_block.wait(60))  # False: the forward waited for the whole step

    state.optimizer.register_step_pre_hook(hold_the_last_sub_group)
    lrs = []
    for x, y in make_batches(case.steps, world * case.micro_batch * case.gas):
        for k in range(case.gas):
            rows = slice((k * world + rank) * case.micro_batch, (k * world + rank + 1) * case.micro_batch)
            engine.backward(engine(x[rows], y[rows]))
            if k == case.gas - 1:
                first_block.clear()  # set again by the next forward, while this step runs
            engine.step()
        lrs.append(engine.get_lr()[0])
    params = {k: v.float() for k, v in engine.consolidated_state_dict(rank0_only=False).items()}
    waited = engine.disk_io()["behind_wait_s"]
    engine.destroy()
    return held, lrs, params, waited


def test_the_step_behind_the_forward_is_the_synchronous_step():
    """Exact: clipping that clips, 2 micro-batches, and a warm-up schedule that changes the learning rate right
    after each ``engine.step()``, while that step is still running; and it overlaps: every step but the last is
    held at its last sub-group until the next forward has gathered the first block. With the optimizer on NVMe,
    with the parameter shards there too (the forward reads each shard from the file the step writes, through the
    buffers both threads share), and with each fp32 shard its own master (published once its write is submitted)."""
    warmup = (("scheduler", {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3, "warmup_num_steps": 10}}),)
    runs, expected = run_distributed(step_behind_worker, 2, warmup)[0]
    for variant, (held, lrs, params, waited) in runs.items():
        assert held == [True, True, True] and len(set(lrs)) == len(lrs), variant  # the schedule moved every step
        assert waited >= 0
        for name, value in expected.items():
            assert torch.equal(params[name], value), (variant, name)


RATIOS = (0.0, 0.25, 0.5, 0.75, "auto", 1.0)
KEEP_ON_DEVICE = 130_000  # ratio "auto": at 16 bytes per element (AdamW), the two flat groups reduced last fit


def ratio_cases(where):
    """Stage 3, one flat group per block (so each ratio keeps a different number on the device), clipping that
    clips, 2 micro-batches."""
    target = {"device": where, "keep_on_device_bytes": KEEP_ON_DEVICE}
    target.update({"nvme_path": SWAP} if where == "nvme" else {})
    return [
        ParityCase(3, "fp32", 2, lr=1e-3, clip=0.05, steps=3,
                   zero=UNITS + (("sub_group_size", SUB_GROUP), ("offload_optimizer", {**target, "ratio": ratio})))
        for ratio in RATIOS
    ]  # fmt: skip


@pytest.mark.parametrize("where", ["cpu", "nvme"])
def test_partial_offload_is_the_same_arithmetic_at_every_ratio(where):
    """``offload_optimizer.ratio`` (Twin-Flow): the flat groups reduced last stay on the device, the rest are
    offloaded; bit for bit at every ratio (the same arithmetic, wherever it runs), and the bytes per location are
    the analytic count: kept flat groups hold their gradient and moments on the device (the fp32 master is the shard
    itself there), offloaded ones in host memory or on disk (twice the master and the moments with the step during
    backward, on by default with NVMe)."""
    import zeroshard
    from zeroshard.offload import choose_kept

    cases = ratio_cases(where)
    results = run_distributed(engine_train_many, 2, cases)[0]
    everything = results[-1]  # ratio 1: all offloaded, the run test_offload_matches_... compares with no offload
    for ratio, result, case in zip(RATIOS, results, cases):
        for name, value in everything["params"].items():
            assert torch.equal(result["params"][name], value), (ratio, name)
        shards = [numel // 2 for numel, _ in result["flat_numels"]]
        kept = choose_kept(shards, ratio, KEEP_ON_DEVICE)
        on_device = sum(n for k, n in enumerate(shards) if k in kept)
        offloaded = sum(shards) - on_device
        if ratio == "auto":
            assert 16 * on_device <= KEEP_ON_DEVICE and 0 < on_device < sum(shards)
        else:
            assert on_device <= (1 - ratio) * sum(shards) and (ratio < 1 or on_device == 0)
            assert kept or ratio == 1.0  # at least the last flat group fits each ratio here
        device, host, nvme = (result["state_bytes_by_location"][where] for where in ("device", "host", "nvme"))
        assert device["optimizer_state"] == 8 * on_device and device["grad_shard"] == 4 * on_device, ratio
        assert device["master"] == 0  # the kept masters are the fp32 shards themselves (counted as params)
        if where == "cpu":
            assert host["master"] == 4 * offloaded and host["optimizer_state"] >= 8 * offloaded
            assert host["grad_shard"] == 4 * offloaded
        else:
            assert nvme["master"] == 8 * offloaded and nvme["optimizer_state"] == 16 * offloaded
        # zeroshard estimate chooses the same flat groups: its optimizer side per location within 10%
        predicted = zeroshard.estimate(make_model, case.config(), world_size=2)
        assert any(f"offload_optimizer.ratio {ratio}" in note for note in predicted.notes) or ratio == 1.0
        for location, held in (("device", device), ("host", host), ("nvme", nvme)):
            measured = held["master"] + held["optimizer_state"] + held["grad_shard"]
            expected = predicted.bytes["optimizer_state"][location] + predicted.bytes["gradients"][location]
            assert abs(expected - measured) <= 0.1 * max(measured, 1), (ratio, location, expected, measured)


def host_link_worker(cases: list[ParityCase]) -> list[dict]:
    """Each case's bytes across the host link in its second step (the first makes the optimizer state), counted
    by the seam that slows the link (here at a bandwidth that slows nothing), with its flat groups and its
    all-gathers' bytes in that step."""
    import zeroshard
    from zeroshard import comm
    from zeroshard.testing import slow_host_link

    results = []
    with slow_host_link(1e15) as link:
        for case in cases:
            engine, *_ = zeroshard.initialize(model=make_model(), config=case.config())
            x, y = next(iter(make_batches(1, 2 * case.micro_batch, vocab_size=case.model.vocab_size)))
            rows = slice(comm.get_rank() * case.micro_batch, (comm.get_rank() + 1) * case.micro_batch)
            engine.backward(engine(x[rows], y[rows]))
            engine.step()
            engine.comm_ledger.reset()
            before = dict(link.moved)
            engine.backward(engine(x[rows], y[rows]))
            engine.step()
            gathered = sum(t.bytes for (op, _), t in engine.comm_ledger.summary().items() if op == "all_gather")
            results.append({
                "moved": {k: link.moved[k] - before[k] for k in before},
                "shards": [f.layout.shard_numel for f in engine.stack.flat_groups],
                "kept": sorted(getattr(engine.stack.optimizer_state, "kept", ())),
                "gathered": gathered,
            })  # fmt: skip
    return results


def test_the_host_link_carries_the_gradient_out_and_the_update_back():
    """The copies that cross between the compute device and host memory (``zeroshard.testing.slow_host_link``
    counts them, and slows them to a PCIe bandwidth in ``benchmarks/offload_capacity.py --host_link_gbps``), per
    step and rank, are the analytic ones: with the optimizer on the host, each offloaded flat group's fp32 gradient
    shard goes out once and its updated shard comes back once (a flat group ``ratio`` keeps on the device crosses
    nothing); with the parameters on the host too, each gather brings its shard to the device and the update stays
    on the host; without offload nothing crosses."""
    cpu = {"device": "cpu"}
    zeros = {
        "stage 2": (2, (("offload_optimizer", cpu),)),
        "stage 3": (3, UNITS + (("offload_optimizer", cpu),)),
        "stage 3, ratio 0.5": (3, UNITS + (("offload_optimizer", {**cpu, "ratio": 0.5}),)),
        "stage 3, params too": (3, UNITS + (("offload_optimizer", cpu), ("offload_param", cpu))),
        "stage 3, no offload": (3, UNITS),
    }
    cases = [ParityCase(stage, "fp32", 2, lr=1e-3, steps=2, zero=zero) for stage, zero in zeros.values()]
    results = run_distributed(host_link_worker, 2, cases)
    for rank_results in results:
        for name, result in zip(zeros, rank_results):
            shard_bytes = [4 * n for k, n in enumerate(result["shards"]) if k not in result["kept"]]
            moved = result["moved"]
            if name == "stage 3, no offload":
                assert moved == {"to_host": 0, "to_device": 0}, name
            elif name == "stage 3, params too":
                assert moved["to_host"] == sum(shard_bytes), name
                # each shard gathered once or more
                assert moved["to_device"] == result["gathered"] // 2 >= sum(shard_bytes), name
            else:
                assert moved == {"to_host": sum(shard_bytes), "to_device": sum(shard_bytes)}, name
                assert (name == "stage 3, ratio 0.5") == bool(result["kept"]), name
