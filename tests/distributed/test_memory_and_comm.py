"""Model-state bytes per rank and bytes communicated per step equal the analytic ZeRO values."""

import math

import pytest

from zeroshard.testing import run_distributed
from zeroshard.testing.parity import ParityCase, engine_train_many

STEPS = 3
CASES = [ParityCase(stage=s, gas=g, dtype=d, steps=STEPS) for s in (0, 1, 2) for g in (1, 2) for d in ("fp32", "bf16")]


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def run(request):
    return request.param, run_distributed(engine_train_many, request.param, CASES)


def test_master_and_optimizer_state_are_one_nth(run):
    world, per_rank = run
    for case, result in zip(CASES, per_rank[0]):
        p = result["num_params"]  # parameters() counts the tied LM head and embedding once
        b = result["state_bytes"]
        if case.stage == 0:
            assert b["master"] == 4 * p and b["optimizer_state"] == 8 * p
        else:
            shard = math.ceil(p / world)  # one bucket: padded to a multiple of the world size
            assert b["master"] == 4 * shard and b["grad_shard"] == 4 * shard
            assert b["optimizer_state"] == 2 * 4 * shard  # Adam: exp_avg + exp_avg_sq
        assert b["staging"] == 0  # transient buffers are freed after each step


def test_bytes_per_step_match_analytic_values(run):
    world, per_rank = run
    for case, result in zip(CASES, per_rank[0]):
        p = result["num_params"]
        elem = 4 if case.dtype == "fp32" else 2
        ledger = result["ledger"]
        padded = math.ceil(p / world) * world
        if case.stage == 0:
            assert ledger["all_reduce/world"] == (STEPS, STEPS * p * elem)
            analytic = 2 * (world - 1) / world * p * elem
        else:
            reductions = STEPS * (case.gas if case.stage == 2 else 1)
            assert ledger["reduce_scatter/shard"] == (reductions, reductions * padded * elem)
            assert ledger["all_gather/shard"] == (STEPS, STEPS * padded * elem)
            assert ledger["all_reduce/shard"] == (STEPS, STEPS * 4)  # the global gradient norm
            grad_passes = case.gas if case.stage == 2 else 1
            analytic = (grad_passes + 1) * (world - 1) / world * padded * elem + 2 * (world - 1) / world * 4
        assert result["wire_bytes"] / STEPS == pytest.approx(analytic, rel=1e-12)
        # the ZeRO paper's 2P: stages 0-2 move the same bytes per step (without accumulation)
        if case.gas == 1:
            assert result["wire_bytes"] / STEPS == pytest.approx(2 * (world - 1) / world * p * elem, rel=1e-3)
