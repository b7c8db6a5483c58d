"""The optimizer step run behind the forward, on one process (a group of one issues no collective): the same
arithmetic as the synchronous step whatever the hyperparameters do meanwhile, a reader waits for its own flat group
only, and a failure reaches the reader with the rank and the step named. The worker is held at a chosen sub-group
by a step pre-hook (torch's own hook), so each ordering is forced, not timed."""

import threading

import pytest
import torch

from zeroshard.zero import HostState
from zeroshard.zero.grad_home import ResidentGrad
from zeroshard.zero.step_behind import StepBehindError, frozen_groups

from .test_reducer_and_optimizer_state import _flat

HELD = 30.0  # seconds a held worker waits for the training thread before the test fails


def _host_state(seed=0):
    torch.manual_seed(seed)
    flats = [
        _flat([torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(5))], False, f"f{k}p")
        for k in range(2)
    ]
    groups = [{"params": [p for f in flats for p in f.params], "lr": 0.1, "weight_decay": 0.01}]
    state = HostState(
        flats, [0, 0], groups, lambda g, _: torch.optim.AdamW(g), torch.float32, sub_group_size=4, pin_memory=False
    )
    grads = [ResidentGrad(torch.randn(f.layout.shard_numel), "host") for f in flats]
    return state, grads


def _flat_being_stepped(state):
    return next(sub.flat_index for sub in state.subgroups if sub.param.grad is not None)


def _hold_at(state, flat_index, released: threading.Event, action=None):
    """Hold the worker at the first sub-group of ``flat_index`` until ``released`` (then run ``action``)."""

    def hook(optimizer, args, kwargs):
        if _flat_being_stepped(state) == flat_index and not released.is_set():
            assert released.wait(HELD), "the training thread never released the step"
            if action is not None:
                action()

    return state.optimizer.register_step_pre_hook(hook)


def test_frozen_groups_step_with_the_hyperparameters_of_their_making():
    param = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.SGD([param], lr=0.5)
    frozen = frozen_groups(optimizer)
    optimizer.param_groups[0]["lr"] = 100.0  # a scheduler, after the step started
    param.grad = torch.ones(4)
    frozen.step()
    assert torch.equal(param.detach(), torch.full((4,), 0.5))
    assert frozen.state is optimizer.state and frozen.param_groups[0]["params"] is optimizer.param_groups[0]["params"]


def test_a_step_behind_equals_the_synchronous_step_whatever_the_scheduler_does_meanwhile():
    sync, sync_grads = _host_state()
    sync.step(sync_grads, coef=0.5)
    behind, grads = _host_state()
    released, cleared = threading.Event(), []
    _hold_at(behind, 0, released)
    behind.step_behind(grads, 0.5, order=[1, 0], then=lambda: cleared.append(True), label="optimizer step 1")
    behind.optimizer.param_groups[0]["lr"] = 10.0  # the engine's lr_scheduler.step(), while the step runs
    released.set()
    behind.settle()
    assert cleared == [True]
    for mine, theirs in zip(behind.flats, sync.flats):
        assert torch.equal(mine.shard_values(), theirs.shard_values())
    assert behind.behind.waited_s >= 0 and not behind.behind.running
    behind.close()


def test_a_reader_waits_for_its_own_flat_group_only():
    state, grads = _host_state()
    released = threading.Event()
    _hold_at(state, 1, released)
    state.step_behind(grads, 1.0, order=[0, 1], then=lambda: None, label="optimizer step 1")
    state.flats[0].await_update()  # published before the held sub-group: returns while the step still runs
    assert state.behind.running and not state.flats[1]._update.done()
    released.set()
    state.flats[1].await_update()
    state.close()


def test_a_failed_step_behind_reaches_the_reader_naming_the_rank_and_the_step():
    state, grads = _host_state()
    released = threading.Event()
    released.set()

    def hook(optimizer, args, kwargs):
        if _flat_being_stepped(state) == 1:
            raise OSError("swap file truncated")

    state.optimizer.register_step_pre_hook(hook)
    state.step_behind(grads, 1.0, order=[0, 1], then=lambda: None, label="optimizer step 7")
    state.flats[0].await_update()  # published before the failure
    with pytest.raises(StepBehindError, match=r"rank 0: optimizer step 7, running behind .* swap file truncated"):
        state.flats[1].await_update()
    with pytest.raises(StepBehindError, match="optimizer step 7"):
        state.settle()
    state.settle()  # raised once: the next use goes on
    state.close()


def test_a_shard_that_is_its_own_master_is_published_once_its_write_is_submitted(tmp_path):
    """Shards on NVMe, each one sub-group in fp32: the step's write of the master *is* the shard's update, so a
    gather may read the region only after that write was submitted (the file runs requests in that order)."""
    from zeroshard.offload import OffloadPlan, ShardHomes
    from zeroshard.zero.offloaded_state import NvmeState

    path = str(tmp_path)
    plan = OffloadPlan("nvme", "nvme", optimizer_nvme_path=path, param_nvme_path=path, max_in_cpu=0)
    homes = ShardHomes(plan, torch.float32, largest_shard=11)
    torch.manual_seed(0)
    flats = [
        _flat([torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(5))], False, f"f{k}p")
        for k in range(3)
    ]
    for flat in flats:  # placed as the engine places them
        flat.home, flat.shard = homes.place(flat.shard), None
    groups = [{"params": [p for f in flats for p in f.params], "lr": 0.1}]
    make = lambda g, _: torch.optim.AdamW(g)  # noqa: E731
    state = NvmeState(flats, [0, 0, 0], groups, make, torch.float32, offload=plan, synchronize=lambda: None)
    region = homes.file.size // 3  # one aligned region per shard, each written once at placement
    assert len(state.subgroups) == 3 and homes.file.stats.written == 3 * region
    grads = [ResidentGrad(torch.randn(f.layout.shard_numel), "host") for f in flats]
    released, written_at_publish = threading.Event(), {}
    _hold_at(state, 2, released)  # the first flat group of the order, before anything is published
    state.step_behind(grads, 1.0, order=[2, 0, 1], then=lambda: None, label="optimizer step 1")
    for k, flat in enumerate(flats):  # the futures the step resolves as it publishes (callbacks on its thread)
        flat._update.add_done_callback(lambda _, k=k: written_at_publish.setdefault(k, homes.file.stats.written))
    released.set()
    state.settle()
    assert written_at_publish == {2: 4 * region, 0: 5 * region, 1: 6 * region}  # its own master's write included
    state.close()
