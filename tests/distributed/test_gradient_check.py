"""``gradient_check``: the reduction checks itself at the step it goes wrong (Note [gradient check] in
``zeroshard/zero/gradient_check.py``).

Faults are put into the real reduction through ``zeroshard.testing.faults`` (a dropped bucket, a wrong divisor,
the wrong process group); each must be caught at the step it happens, on every rank, naming the flat group and the
process groups. Without faults, 200 steps at every stage in fp32 and bf16 raise nothing, and the largest
difference seen stays well inside the tolerance.

Two spawns: 2 ranks (stages 0-3, fp32 and bf16, several flat groups, accumulation), 4 ranks (TP=2 x DP=2 with the
tensor-parallel group as the wrong one; SP=2 x DP=2 with the gradient left scaled by the sequence degree).
"""

from __future__ import annotations

import pytest
import torch

from zeroshard.testing import run_distributed

CLEAN_STEPS, FAULT_AT = 200, 4


def _config(stage: int, dtype: str, shard_size: int = 0, **check) -> dict:
    from zeroshard.testing.parity import ParityCase

    case = ParityCase(
        stage=stage,
        dtype=dtype,
        shard_size=shard_size,
        gas=2 if stage in (1, 2) else 1,
        bucket_size=8192,  # several flat groups
        zero=(("stage3_param_persistence_threshold", 0),) if stage == 3 else (),
        extra=(("gradient_check", {"enabled": True, **check}),),
    )
    return case.config(), case


def _run(engine, losses, gas: int = 1, fault=None, at: int = FAULT_AT, wrap=None) -> tuple[int, str]:
    """Train on ``losses`` (each a callable giving one micro-batch's loss), ``gas`` micro-batches per step.
    ``fault(engine)`` runs on rank 0 between the last backward and the step of step ``at``; ``wrap(engine)``
    (every rank) is a context around that step's backward and step. Returns (the step that raised, its message),
    or (0, "") when none did."""
    import contextlib

    from zeroshard import comm
    from zeroshard.zero.gradient_check import GradientCheckError

    for i, loss_of in enumerate(losses):
        step, boundary = i // gas + 1, (i + 1) % gas == 0
        with wrap(engine) if wrap is not None and step == at else contextlib.nullcontext():
            engine.backward(loss_of())
            if fault is not None and step == at and boundary and comm.get_rank() == 0:
                fault(engine)
            try:
                engine.step()
            except GradientCheckError as err:
                return step, str(err)
    return 0, ""


def _train(engine, case, steps: int, fault=None, at: int = FAULT_AT) -> tuple[int, str]:
    """The tiny GPT on ``steps`` optimizer steps of the parity batches (each rank its rows)."""
    from zeroshard import comm
    from zeroshard.testing.parity import make_batches

    rank, world = comm.get_rank(), comm.get_world_size()
    rows = slice(rank * case.micro_batch, (rank + 1) * case.micro_batch)
    batches = make_batches(steps * case.gas, case.micro_batch * world, seed=engine.global_steps + 1)
    losses = [lambda x=x, y=y: engine(x[rows], y[rows]) for x, y in batches]
    return _run(engine, losses, case.gas, fault, at)


def two_rank_worker() -> dict:
    import zeroshard
    from zeroshard.testing import faults
    from zeroshard.testing.parity import make_model

    out = {}
    for dtype in ("fp32", "bf16"):
        for stage in (0, 1, 2, 3):
            config, case = _config(stage, dtype)
            engine, *_ = zeroshard.initialize(model=make_model(), config=config)
            check = engine.stack.reducer.check
            out[(dtype, stage, "clean")] = (*_train(engine, case, CLEAN_STEPS), check.largest_ratio, len(check.buckets))
            engine.destroy()
            for label, fault in (
                ("dropped", lambda e: faults.drop_reduced_bucket(e, 1)),
                ("divisor", lambda e: faults.scale_reduced_bucket(e, 1, 2.0)),
            ):
                engine, *_ = zeroshard.initialize(model=make_model(), config=config)
                out[(dtype, stage, label)] = _train(engine, case, FAULT_AT + 2, fault)
                engine.destroy()
    # every 3rd step only: a fault at step 2 goes by, one at step 4 is caught
    config, case = _config(2, "fp32", interval=3)
    engine, *_ = zeroshard.initialize(model=make_model(), config=config)
    out["interval"] = (
        _train(engine, case, 3, lambda e: faults.scale_reduced_bucket(e, 0, 2.0), at=2),
        _train(engine, case, 3, lambda e: faults.scale_reduced_bucket(e, 0, 2.0), at=1),
    )
    engine.destroy()
    # a gradient the caller writes through param_access is not backward's: that step is not compared
    config, case = _config(2, "fp32")
    engine, *_ = zeroshard.initialize(model=make_model(), config=config)
    param = next(p for p in engine.module.parameters() if p.requires_grad)
    written = _train(engine, case, 2, lambda e: e.param_access.set_full_grad(param, torch.ones_like(param)), at=2)
    out["param_access"] = (written, _train(engine, case, 2))
    engine.destroy()
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list:
    return run_distributed(two_rank_worker, 2, timeout_s=900)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_no_false_alarm_in_200_steps(two_ranks, stage, dtype):
    for out in two_ranks:
        step, message, largest, flat_groups = out[(dtype, stage, "clean")]
        assert (step, message) == (0, ""), message
        assert flat_groups > 1 and largest < 0.5, largest  # the largest difference seen, in tolerances


@pytest.mark.parametrize("fault", ["dropped", "divisor"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_dropped_bucket_or_a_wrong_divisor_is_caught_at_its_step_on_every_rank(two_ranks, stage, dtype, fault):
    for out in two_ranks:
        step, message = out[(dtype, stage, fault)]
        assert step == FAULT_AT, message
        assert f"gradient check failed at optimizer step {FAULT_AT} for flat group 1" in message, message
        group = "'world'" if stage == 0 else "'shard'"
        assert f"reduced over process group {group} ranks [0, 1] and averaged over 'world' ranks [0, 1]" in message


def test_the_interval_and_gradients_written_by_the_caller(two_ranks):
    for out in two_ranks:
        missed, caught = out["interval"]
        assert missed == (0, "") and caught[0] == 1, caught  # checked steps: 1, 4 (the 4th optimizer step overall)
        written, after = out["param_access"]
        assert written == (0, "") and after == (0, "")


# -- 4 ranks: tensor and sequence parallelism -------------------------------------------------------------------------
def _llama(**overrides):
    from zeroshard.testing.hf import tiny_causal_lm

    shape = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)
    return tiny_causal_lm("llama", max_position_embeddings=16, attn_implementation="sdpa", **{**shape, **overrides})


def _hf_config(stage: int, **parallel) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "gradient_check": {"enabled": True},
        **parallel,
    }


def _hf_train(engine, steps: int, fault=None, wrap=None, loss_of=None) -> tuple[int, str]:
    """The tiny Llama on ``steps`` steps; the ranks of one tensor-parallel group see the same batch."""
    ids = torch.randint(0, 64, (steps, 4, 16), generator=torch.Generator().manual_seed(5))
    data = engine.mesh.gradient.rank  # data-parallel (x sequence) index
    batches = [ids[step, data % 4 : data % 4 + 1] for step in range(steps)]
    if loss_of is None:
        losses = [lambda b=b: engine(input_ids=b, labels=b).loss for b in batches]
    else:
        losses = [lambda b=b: loss_of(engine, b) for b in batches]
    return _run(engine, losses, fault=fault, wrap=wrap)


def four_rank_worker() -> dict:
    import zeroshard
    from zeroshard.sequence_parallel import register_with_transformers, token_weighted_loss
    from zeroshard.testing import faults

    out = {}
    for stage in (1, 3):  # TP=2 x DP=2: data groups {0, 2} {1, 3}, tensor groups {0, 1} {2, 3}
        config = _hf_config(stage, tensor_parallel={"autotp_size": 2})
        for label, kwargs in (
            ("clean", {}),
            ("wrong_group", {"wrap": lambda e: faults.reduce_over(e, 0, e.mesh.tensor)}),
            ("dropped", {"fault": lambda e: faults.drop_reduced_bucket(e, 0)}),
        ):
            engine, *_ = zeroshard.initialize(model=_llama(), config=config)
            out[("tp", stage, label)] = _hf_train(engine, 8 if label == "clean" else FAULT_AT + 1, **kwargs)
            engine.destroy()
    # hybrid sharding (shard groups of 2 in 4 ranks, replicas all-reduced): each shard is counted once
    from zeroshard.testing.parity import make_model

    config, case = _config(3, "fp32", shard_size=2)
    for label, fault in (("clean", None), ("dropped", lambda e: faults.drop_reduced_bucket(e, 1))):
        engine, *_ = zeroshard.initialize(model=make_model(), config=config)
        out[("hybrid", label)] = _train(engine, case, 12 if fault is None else FAULT_AT + 1, fault)
        engine.destroy()
    # SP=2 x DP=2: the reduction averages over all 4 ranks; a gradient left scaled by the sequence degree
    mpu = register_with_transformers(_llama(), "sdpa", 2, micro_batch_size=1)
    rank = zeroshard.comm.get_rank()

    def sp_loss(engine, batch):
        piece = batch[:, rank % 2 * 8 : rank % 2 * 8 + 8]
        positions = torch.arange(rank % 2 * 8, rank % 2 * 8 + 8)[None]
        shift = torch.roll(piece, -1, 1)
        loss = engine(input_ids=piece, position_ids=positions, labels=shift, shift_labels=shift).loss
        return token_weighted_loss(loss, shift, mpu.sequence)

    for label, kwargs in (("clean", {}), ("scaled", {"fault": lambda e: faults.scale_reduced_bucket(e, 0, 2.0)})):
        engine, *_ = zeroshard.initialize(model=_llama(), config=_hf_config(2), mpu=mpu)
        out[("sp", label)] = _hf_train(engine, 8 if label == "clean" else FAULT_AT + 1, loss_of=sp_loss, **kwargs)
        engine.destroy()
    return out


@pytest.fixture(scope="module")
def four_ranks() -> list:
    return run_distributed(four_rank_worker, 4, timeout_s=300)


@pytest.mark.parametrize("stage", [1, 3])
def test_tensor_parallel_reduction_over_the_wrong_group_or_dropped_is_caught(four_ranks, stage):
    for rank, out in enumerate(four_ranks):
        assert out[("tp", stage, "clean")] == (0, ""), out[("tp", stage, "clean")]
        data = [0, 2] if rank % 2 == 0 else [1, 3]
        step, message = out[("tp", stage, "wrong_group")]  # on every rank: each data group sees it
        assert step == FAULT_AT and "flat group 0" in message, (rank, message)
        assert "reduced over process group 'tensor'" in message and f"averaged over 'gradient' ranks {data}" in message
        step, message = out[("tp", stage, "dropped")]  # on rank 0: its data group names it, the others stop too
        assert step == FAULT_AT, (rank, message)
        if rank in (0, 2):
            assert "flat group 0" in message and "averaged over 'gradient' ranks [0, 2]" in message, message
        else:
            assert "in another data-parallel group than 'gradient' ranks [1, 3]" in message, message


def test_hybrid_sharding_counts_each_shard_once(four_ranks):
    for out in four_ranks:
        assert out[("hybrid", "clean")] == (0, "")
        step, message = out[("hybrid", "dropped")]
        assert step == FAULT_AT and "flat group 1" in message and "averaged over 'world' ranks [0, 1, 2, 3]" in message


def test_sequence_parallel_gradient_left_scaled_is_caught(four_ranks):
    for out in four_ranks:
        assert out[("sp", "clean")] == (0, "")
        step, message = out[("sp", "scaled")]
        assert step == FAULT_AT and "ranks [0, 1, 2, 3]" in message, message
