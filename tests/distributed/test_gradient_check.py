"""``gradient_check``: the reduction checks itself at the step it goes wrong (Note [gradient check] in
``zeroshard/zero/gradient_check.py``).

Faults are put into the real reduction through ``zeroshard.testing.faults`` (a dropped bucket, a wrong divisor,
the wrong process group); each must be caught at the step it happens, on every rank, naming the flat group and the
process groups. Without faults, 20 steps (200 under the stress marker) at every stage in fp32 and bf16 raise
nothing, and the largest difference seen stays well inside the tolerance.

Two spawns: 2 ranks (stages 0-3, fp32 and bf16, several flat groups, accumulation), 4 ranks (TP=2 x DP=2 with the
tensor-parallel group as the wrong one; SP=2 x DP=2 with the gradient left scaled by the sequence degree).
"""

from __future__ import annotations

import pytest
import torch

from zeroshard.testing import run_distributed

CLEAN_STEPS, STRESS_STEPS, FAULT_AT = 20, 200, 4


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


def _train(engine, case, steps: int, fault=None, at: int = FAULT_AT, scale: float = 1.0) -> tuple[int, str]:
    """The tiny GPT on ``steps`` optimizer steps of the parity batches (each rank its rows), the loss times
    ``scale``."""
    from zeroshard import comm
    from zeroshard.testing.parity import make_batches

    rank, world = comm.get_rank(), comm.get_world_size()
    rows = slice(rank * case.micro_batch, (rank + 1) * case.micro_batch)
    batches = make_batches(steps * case.gas, case.micro_batch * world, seed=engine.global_steps + 1)
    losses = [lambda x=x, y=y: engine(x[rows], y[rows]) * scale for x, y in batches]
    return _run(engine, losses, case.gas, fault, at)


def _gradient_sizes(case, scale: float) -> tuple[float, float]:
    """The largest and the median nonzero |gradient| of one process's first backward at ``scale``."""
    from zeroshard.testing.parity import make_batches, make_model

    model = make_model()
    x, y = make_batches(1, case.micro_batch, seed=1)[0]
    (model(x, y) * scale).backward()
    grads = torch.cat([p.grad.reshape(-1).abs() for p in model.parameters() if p.grad is not None])
    return grads.max().item(), grads[grads > 0].median().item()


def _expert_bucket(engine) -> int:
    """The first flat group of experts."""
    return next(k for k, b in enumerate(engine.stack.reducer.buckets) if b.layout.split_axis == "ep")


class ExpertNet(torch.nn.Module):
    """DeepSpeed's MoE layer (4 experts of a small MLP, top-1) as a model with its loss."""

    def __init__(self, ep_size: int):
        from zeroshard.moe import MoE

        super().__init__()
        torch.manual_seed(0)
        expert = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
        self.moe = MoE(8, expert, num_experts=4, ep_size=ep_size, k=1, use_rts=False)

    def forward(self, x, target):
        out, l_aux, _ = self.moe(x)
        return (out - target).pow(2).mean() + 0.1 * l_aux


def _experts(stage: int, ep: int, steps: int, layer: bool, fault: bool) -> tuple[int, str]:
    """Expert parallelism over ``ep`` ranks: DeepSpeed's MoE layer (``layer``) or AutoEP on a tiny Mixtral; with
    ``fault`` rank 0's first flat group of experts is dropped at step ``FAULT_AT``."""
    import zeroshard
    from zeroshard.testing import faults

    drop = (lambda e: faults.drop_reduced_bucket(e, _expert_bucket(e))) if fault else None
    if not layer:
        from zeroshard.testing.hf import tiny_causal_lm

        config = _hf_config(stage, expert_parallel={"enabled": True, "autoep_size": ep, "preset_model": "mixtral"})
        engine, *_ = zeroshard.initialize(model=tiny_causal_lm("mixtral"), config=config)
        result = _hf_train(engine, steps, fault=drop)
    else:
        engine, *_ = zeroshard.initialize(model=ExpertNet(ep), config=_hf_config(stage))
        g = torch.Generator().manual_seed(7 + engine.mesh.gradient.rank)
        data = [(torch.randn(2, 4, 8, generator=g), torch.randn(2, 4, 8, generator=g)) for _ in range(steps)]
        result = _run(engine, [lambda x=x, t=t: engine(x, t) for x, t in data], fault=drop)
    engine.destroy()
    return result


def _expert_cases(ep: int) -> dict:
    out = {}
    for layer in (True, False):
        for stage in (0, 1, 2, 3):
            out[("ep", ep, layer, stage, "clean")] = _experts(stage, ep, 6, layer, False)
        for stage in (1, 3):
            out[("ep", ep, layer, stage, "dropped")] = _experts(stage, ep, FAULT_AT + 1, layer, True)
    return out


def clean_runs(steps: int) -> dict:
    """Every stage in fp32 and bf16 without faults: (failed step, message, largest difference seen, flat groups)."""
    import zeroshard
    from zeroshard.testing.parity import make_model

    out = {}
    for dtype in ("fp32", "bf16"):
        for stage in (0, 1, 2, 3):
            config, case = _config(stage, dtype)
            engine, *_ = zeroshard.initialize(model=make_model(), config=config)
            check = engine.stack.reducer.check
            out[(dtype, stage, "clean")] = (*_train(engine, case, steps), check.largest_ratio, len(check.buckets))
            engine.destroy()
    return out


def two_rank_worker() -> dict:
    import zeroshard
    from zeroshard.testing import faults
    from zeroshard.testing.parity import make_model

    out = clean_runs(CLEAN_STEPS)
    for dtype in ("fp32", "bf16"):
        for stage in (0, 1, 2, 3):
            config, case = _config(stage, dtype)
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
    # gradients at the ends of the float range: ~1e19 (a diverging run) and subnormal (~1e-41 in fp32)
    for dtype, scale in (("fp32", 1e20), ("bf16", 1e20), ("fp32", 1e-40), ("bf16", 1e-37)):
        config, case = _config(2, dtype)
        for label, fault in (("clean", None), ("dropped", lambda e: faults.drop_reduced_bucket(e, 1))):
            engine, *_ = zeroshard.initialize(model=make_model(), config=config)
            out[("scale", dtype, scale, label)] = _train(
                engine, case, 6 if fault is None else FAULT_AT + 1, fault, scale=scale
            )
            engine.destroy()
        out[("scale", dtype, scale, "sizes")] = _gradient_sizes(case, scale)
    out.update(_expert_cases(2))  # EP=2 on 2 ranks: each expert held by one rank
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list:
    return run_distributed(two_rank_worker, 2, timeout_s=900)


def _no_false_alarm(runs: list, stage: int, dtype: str) -> None:
    for out in runs:
        step, message, largest, flat_groups = out[(dtype, stage, "clean")]
        assert (step, message) == (0, ""), message
        assert flat_groups > 1 and largest < 0.5, largest  # the largest difference seen, in tolerances


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_no_false_alarm_in_20_steps(two_ranks, stage, dtype):
    _no_false_alarm(two_ranks, stage, dtype)


@pytest.fixture(scope="module")
def long_clean_runs() -> list:
    return run_distributed(clean_runs, 2, STRESS_STEPS, timeout_s=900)


@pytest.mark.stress
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_no_false_alarm_in_200_steps(long_clean_runs, stage, dtype):
    _no_false_alarm(long_clean_runs, stage, dtype)


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
    out.update(_expert_cases(2))  # EP=2 x DP=2: experts summed over {0, 2} and {1, 3}, divided by 4
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


# -- expert parallelism and the ends of the float range -------------------------------------------------------------
@pytest.mark.parametrize("layer", [True, False], ids=["moe_layer", "autoep"])
@pytest.mark.parametrize("world", [2, 4])
def test_expert_flat_groups_are_checked_over_the_ranks_holding_the_same_experts(two_ranks, four_ranks, world, layer):
    """No false alarm at stages 0-3 (the expected side sums only the ranks holding the same experts, divided by the
    whole data-parallel size), and an expert bucket dropped on rank 0 is caught at its step on every rank."""
    runs = two_ranks if world == 2 else four_ranks
    for rank, out in enumerate(runs):
        for stage in (0, 1, 2, 3):
            assert out[("ep", 2, layer, stage, "clean")] == (0, ""), (stage, out[("ep", 2, layer, stage, "clean")])
        for stage in (1, 3):
            step, message = out[("ep", 2, layer, stage, "dropped")]
            assert step == FAULT_AT, (stage, message)
            if rank % 2 == 1:  # holds the other experts: its own checked out, it stops with rank 0
                assert "in another data-parallel group" in message, message
                continue
            holders = [0] if world == 2 else [0, 2]
            assert f"averaged over 'expert_gradient' ranks {holders} (the ranks holding its experts" in message, message


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_dropped_bucket_is_caught_when_gradients_reach_1e19(two_ranks, dtype):
    """Loss x 1e20: gradients near 1e19, whose squares overflow float32; the check must not go blind."""
    for out in two_ranks:
        largest, _ = out[("scale", dtype, 1e20, "sizes")]
        assert largest > 1e19
        assert out[("scale", dtype, 1e20, "clean")] == (0, ""), out[("scale", dtype, 1e20, "clean")]
        step, message = out[("scale", dtype, 1e20, "dropped")]
        assert step == FAULT_AT and "flat group 1" in message, message


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_subnormal_gradients_raise_no_false_alarm(two_ranks, dtype):
    """Loss x 1e-40 (fp32) / 1e-37 (bf16): gradients below the smallest normal number, where rounding is absolute;
    no alarm, and (fp32, where they keep a few digits) a dropped bucket is still caught."""
    scale = 1e-40 if dtype == "fp32" else 1e-37
    smallest_normal = torch.finfo(torch.float32).tiny
    for out in two_ranks:
        _, median = out[("scale", dtype, scale, "sizes")]
        assert median < smallest_normal
        assert out[("scale", dtype, scale, "clean")] == (0, ""), out[("scale", dtype, scale, "clean")]
        if dtype == "fp32":
            step, message = out[("scale", dtype, scale, "dropped")]
            assert step == FAULT_AT and "flat group 1" in message, message
