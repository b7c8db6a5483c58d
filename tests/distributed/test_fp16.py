"""fp16 dynamic loss scaling across ranks: an overflow on one rank skips the step on every rank."""

import math

import pytest
import torch

from zeroshard.testing import run_distributed
from zeroshard.testing.parity import ParityCase, make_batches, make_model

OVERFLOW_STEP = 2


def train_with_injected_overflow(stage: int):
    import zeroshard
    from zeroshard import comm

    case = ParityCase(
        stage=stage,
        dtype="fp16",
        lr=1e-3,
        extra=(("fp16", {"enabled": True, "initial_scale_power": 8, "hysteresis": 1, "loss_scale_window": 2}),),
        zero=(("gather_unit_classes", ["Block"]), ("stage3_param_persistence_threshold", 0)) if stage == 3 else (),
    )
    engine, _, _, _ = zeroshard.initialize(model=make_model(), config=case.config())
    rank, world = comm.get_rank(), comm.get_world_size()
    history, norms = [], []
    for step, (x, y) in enumerate(make_batches(5, world * 2)):
        before = {k: v.detach().clone() for k, v in engine.consolidated_state_dict(rank0_only=False).items()}
        loss = engine(x[rank * 2 : (rank + 1) * 2], y[rank * 2 : (rank + 1) * 2])
        if step == OVERFLOW_STEP and rank == world - 1:
            loss = loss * math.inf  # only the last rank overflows
        engine.backward(loss)
        engine.step()
        unchanged = all(torch.equal(before[k], v) for k, v in engine.consolidated_state_dict(rank0_only=False).items())
        history.append((engine.was_step_applied(), unchanged, engine.get_loss_scale()))
        norms.append(engine.get_global_grad_norm())
    return {"history": history, "skipped": engine.skipped_steps, "steps": engine.global_steps, "norms": norms}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_overflow_on_one_rank_skips_everywhere(stage):
    results = run_distributed(train_with_injected_overflow, 2, stage)
    for r in results:
        assert r["skipped"] == 1 and r["steps"] == 5
        applied = [a for a, _, _ in r["history"]]
        assert applied == [True, True, False, True, True]
        unchanged = [u for _, u, _ in r["history"]]
        assert unchanged == [False, False, True, False, False]
        scales = [s for _, _, s in r["history"]]
        # 256 -> doubled after a window of 2 clean steps -> halved on overflow -> doubled again after 2 clean
        assert scales == [256, 512, 256, 256, 512]
        # the skipped step's norm is inf (the gradients held NaN), as DeepSpeed reports it; the others are finite
        assert r["norms"][OVERFLOW_STEP] == math.inf
        assert all(math.isfinite(n) for i, n in enumerate(r["norms"]) if i != OVERFLOW_STEP)
    assert results[0]["history"] == results[1]["history"]
