"""A distributed failure ends with an error naming the rank and the operation, never a silent hang."""

import time

import pytest
import torch

from zeroshard.testing import WorkerError, WorkerHang, run_distributed


def skip_collective_on_last_rank():
    from zeroshard import comm

    mesh = comm.build_mesh(comm.ParallelDims.for_world(comm.get_world_size()))
    if comm.get_rank() == comm.get_world_size() - 1:
        time.sleep(6)  # never joins the all-reduce (twice rank 0's 3 s timeout; then the harness need not wait longer)
        return None
    comm.all_reduce(torch.ones(4), mesh.world)


def test_missing_collective_times_out_naming_rank_op_and_group():
    # not a hang: the harness would raise WorkerHang instead, naming the ranks still running
    with pytest.raises(WorkerError) as info:
        run_distributed(skip_collective_on_last_rank, 2, comm_timeout_s=3, timeout_s=60)
    message = str(info.value)
    assert "rank 0: all_reduce on group 'world' (ranks [0, 1]) of (4,) float32 failed or timed out" in message


def crash_on_rank_one():
    from zeroshard import comm

    if comm.get_rank() == 1:
        raise RuntimeError("boom on purpose")
    return "fine"


def test_crash_names_the_rank():
    with pytest.raises(WorkerError, match=r"rank 1 failed:[\s\S]*boom on purpose"):
        # 15 s, not less: the same timeout bounds Gloo's connection at start, which a loaded machine can take seconds
        run_distributed(crash_on_rank_one, 2, comm_timeout_s=15)


def hang_without_collective():
    from zeroshard import comm

    if comm.get_rank() == 1:
        time.sleep(60)
    return comm.get_rank()


def test_harness_names_the_hung_rank():
    with pytest.raises(WorkerHang, match=r"ranks \[1\] of 2 did not finish within 8s"):
        run_distributed(hang_without_collective, 2, timeout_s=8)


def bad_config_worker():
    import zeroshard

    zeroshard.initialize(
        model=torch.nn.Linear(2, 2), config={"train_batch_size": 3, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    )


def test_inconsistent_batch_for_world_size_is_reported_by_every_rank():
    with pytest.raises(WorkerError, match="train_batch_size 3 is not divisible by world size 2"):
        run_distributed(bad_config_worker, 2, comm_timeout_s=10)


def diverging_worker(kind):
    """Three warm-up all-reduces, then rank 1 skips one (kind 'skip') or swaps two (kind 'reorder')."""
    from zeroshard import comm

    world = comm.build_mesh(comm.ParallelDims.for_world(comm.get_world_size())).world
    small, large = torch.ones(4), torch.ones(8)
    for _ in range(3):
        comm.all_reduce(small, world)
    if comm.get_rank() == 1:
        if kind == "reorder":
            comm.broadcast(large, 0, world)  # DIVERGENT-BROADCAST
        comm.all_reduce(small, world)
    else:
        comm.all_reduce(small, world)  # EXPECTED-ALL-REDUCE
        if kind == "reorder":
            comm.broadcast(large, 0, world)
    if kind == "skip" and comm.get_rank() != 1:
        comm.all_reduce(small, world)  # rank 1 never issues this one
    comm.barrier(world)  # SKIPPING-RANK-BARRIER


def _line_of(marker: str) -> int:
    lines = open(__file__).read().splitlines()
    return next(i + 1 for i, line in enumerate(lines) if line.rstrip().endswith(marker))


@pytest.mark.parametrize("kind", ["reorder", "skip"])
def test_diverged_collective_names_the_rank_and_call_site(kind):
    with pytest.raises(WorkerError) as info:
        run_distributed(diverging_worker, 3, kind, comm_timeout_s=4, timeout_s=90)
    message = str(info.value)
    if kind == "reorder":
        assert (
            f"collective #4: rank 1 called broadcast on 'world' of (8,) float32 at "
            f"tests/distributed/test_failures.py:{_line_of('# DIVERGENT-BROADCAST')}" in message
        ), message
        assert (
            f"while ranks 0,2 called all_reduce on 'world' of (4,) float32 at "
            f"tests/distributed/test_failures.py:{_line_of('# EXPECTED-ALL-REDUCE')}" in message
        ), message
    else:
        assert (
            "collective #5: rank 1 called barrier on 'world' at "
            f"tests/distributed/test_failures.py:{_line_of('# SKIPPING-RANK-BARRIER')} "
            "while ranks 0,2 called all_reduce on 'world' of (4,) float32" in message
        ), message


def rank_one_skips_the_last_step():
    import zeroshard
    from zeroshard import comm
    from zeroshard.testing.parity import make_batches, make_model

    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": 2}}  # fmt: skip
    engine, *_ = zeroshard.initialize(model=make_model(), config=cfg)
    steps = 3 if comm.get_rank() == 0 else 2
    for x, y in make_batches(steps, 2):
        engine.backward(engine(x, y))  # ONE-MORE-STEP
        engine.step()


def test_a_rank_whose_script_ended_is_named_as_such():
    with pytest.raises(WorkerError) as info:
        run_distributed(rank_one_skips_the_last_step, 2, comm_timeout_s=4, timeout_s=90)
    message = str(info.value)
    assert "rank 1 exited normally after collective #" in message and "(its script ended)" in message, message
    assert "rank 1 failed" not in message  # rank 1 itself finished cleanly
    # the waiting rank names its collective at the user's line, with zeroshard's frame beside it
    line = _line_of("# ONE-MORE-STEP")
    assert "rank 0 is waiting in collective #" in message, message
    assert f"at tests/distributed/test_failures.py:{line} (zeroshard/" in message, message
