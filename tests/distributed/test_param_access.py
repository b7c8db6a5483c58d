"""One parameter's training state through DeepSpeed's names (``deepspeed.utils.safe_get_full_fp32_param`` and its
family) at every stage and with optimizer offload, checked against a single-process reference of the same step;
and ``offload_states`` / ``reload_states``: a bit-exact round trip, measured by continuing to train.

One spawn of 2 ranks runs every configuration (tiny GPT, AdamW, one step then one backward)."""

import pytest
import torch

from zeroshard.testing import run_distributed
from zeroshard.testing.parity import ParityCase, make_batches, make_model

FROZEN = ("wpe.weight",)
CONFIGS = {
    "stage0": ParityCase(stage=0),
    "stage1": ParityCase(stage=1),
    "stage2": ParityCase(stage=2),
    "stage3": ParityCase(stage=3, zero=(("stage3_param_persistence_threshold", 0),)),
    "stage2-offload": ParityCase(stage=2, zero=(("offload_optimizer", {"device": "cpu"}),)),
    "stage3-offload": ParityCase(
        stage=3, zero=(("offload_optimizer", {"device": "cpu"}), ("stage3_param_persistence_threshold", 0))
    ),
}
LR = 1e-3


def _reference_grads(weights: dict, batch) -> dict:
    """The gradient of the mean loss over the global batch at ``weights``, in one process."""
    model = make_model(frozen=FROZEN)
    model.load_state_dict(weights)
    x, y = batch
    model(x, y).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def access_worker() -> dict:
    from zeroshard import comm

    rank, world = comm.get_rank(), comm.get_world_size()
    batches = make_batches(3, 2 * world)
    return {label: _one_config(case, batches, rank, world) for label, case in CONFIGS.items()}


def _one_config(case: ParityCase, batches, rank: int, world: int) -> dict:
    from zeroshard.compat import deepspeed
    from zeroshard.compat.deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum
    from zeroshard.compat.deepspeed.utils import (
        safe_get_full_fp32_param,
        safe_get_full_grad,
        safe_get_full_optimizer_state,
        safe_get_local_fp32_param,
        safe_get_local_grad,
        safe_get_local_optimizer_state,
        safe_set_full_fp32_param,
        safe_set_full_grad,
        safe_set_full_optimizer_state,
        safe_set_local_fp32_param,
        safe_set_local_grad,
        safe_set_local_optimizer_state,
    )
    from zeroshard.zero.state_offload import StatesOffloadedError

    config = case.config()
    config["optimizer"]["params"] = {"lr": LR, "weight_decay": 0.0}
    engine, *_ = deepspeed.initialize(model=make_model(frozen=FROZEN), config=config)
    names = {p: n for n, p in engine.module.named_parameters()}
    start = {n: v.clone() for n, v in engine.consolidated_state_dict(rank0_only=False).items()}
    rows = slice(rank * 2, rank * 2 + 2)

    def step(batch, apply=True):
        x, y = batch
        engine.backward(engine(x[rows], y[rows]))
        if apply:
            engine.step()

    step(batches[0])
    first_grads = _reference_grads(start, (batches[0][0], batches[0][1]))
    after_one = {n: v.clone() for n, v in engine.consolidated_state_dict(rank0_only=False).items()}
    step(batches[1], apply=False)  # gradients of the second batch, not yet applied
    grads = _reference_grads(after_one, batches[1])
    errors = []
    for param, name in names.items():
        if name in FROZEN:
            got = [safe_get_full_fp32_param(param), safe_get_full_grad(param), safe_get_local_grad(param)]
            errors += [f"{name}: frozen answered {g}" for g in got if g is not None]
            continue
        full = safe_get_full_fp32_param(param)
        if not torch.equal(full, after_one[name].float()):
            errors.append(f"{name}: full fp32 differs from the engine's weights")
        pieces = [torch.zeros(0)] * world
        torch.distributed.all_gather_object(pieces, safe_get_local_fp32_param(param))
        whole = pieces[0] if case.stage == 0 else torch.cat(pieces)  # stage 0: every rank holds it all
        if not torch.equal(whole, full.reshape(-1)):
            errors.append(f"{name}: local fragments do not make up the full parameter")
        grad = safe_get_full_grad(param)
        if not torch.allclose(grad, grads[name], rtol=1e-4, atol=1e-7):
            errors.append(f"{name}: full grad off by {(grad - grads[name]).abs().max().item():.3g}")
        if safe_get_local_grad(param).numel() != safe_get_local_fp32_param(param).numel():
            errors.append(f"{name}: local grad and local param fragments differ in size")
        # AdamW's first step from zero state: exp_avg = 0.1 g, exp_avg_sq = 0.001 g^2
        g1 = first_grads[name]
        exp_avg = safe_get_full_optimizer_state(param, "exp_avg")
        if not torch.allclose(exp_avg, 0.1 * g1, rtol=1e-4, atol=1e-9):
            errors.append(f"{name}: exp_avg off by {(exp_avg - 0.1 * g1).abs().max().item():.3g}")
        sq = safe_get_local_optimizer_state(param, "exp_avg_sq")
        if sq.numel() != safe_get_local_fp32_param(param).numel():
            errors.append(f"{name}: local exp_avg_sq fragment has the wrong size")

    # the pending (reduced, not yet applied) gradient: a whole value, then each rank its own fragment
    target = engine.module.blocks[0].fc.weight
    planted = torch.linspace(-1, 1, target.numel()).view(tuple(safe_get_full_grad(target).shape))
    safe_set_full_grad(target, planted)
    grad_ok = torch.equal(safe_get_full_grad(target), planted)
    safe_set_local_grad(target, torch.full_like(safe_get_local_grad(target), float(rank + 1)))
    pieces = safe_get_full_grad(target).reshape(-1)
    grad_ok &= bool(((pieces == 1) | (pieces == 2)).all())  # each element from the rank holding it
    grad_ok &= case.stage > 0 or bool((pieces == rank + 1).all())  # stage 0: every rank holds (and wrote) it all

    # writes: whole values, then each rank its own fragment; reads and the compute weights see them
    name = names[target]
    value = torch.arange(target.numel(), dtype=torch.float32).view(tuple(safe_get_full_fp32_param(target).shape))
    safe_set_full_fp32_param(target, value / 1000)
    safe_set_full_optimizer_state(target, value, "exp_avg")
    set_ok = torch.equal(safe_get_full_fp32_param(target), value / 1000)
    set_ok &= torch.equal(safe_get_full_optimizer_state(target, "exp_avg"), value)
    set_ok &= torch.equal(engine.consolidated_state_dict(rank0_only=False)[name].float(), value / 1000)
    mine = safe_get_local_fp32_param(target)
    safe_set_local_fp32_param(target, torch.full_like(mine, float(rank + 1)))
    safe_set_local_optimizer_state(target, torch.full_like(mine, float(rank + 1) / 8), "exp_avg_sq")
    both = safe_get_full_fp32_param(target).reshape(-1)
    set_ok &= bool(((both == 1) | (both == 2)).all()) and (not bool((both == 2).any()) or world > 1)
    set_ok &= bool((safe_get_full_optimizer_state(target, "exp_avg_sq") > 0).all())

    hostile = []
    for call in (
        lambda: safe_set_full_fp32_param(target, torch.zeros(3)),
        lambda: safe_set_full_fp32_param(target, torch.full_like(value, float("nan"))),
        lambda: safe_get_full_optimizer_state(target, "momentum_buffer"),
        lambda: safe_set_local_fp32_param(target, torch.zeros(mine.numel() + 1)),
        lambda: safe_get_full_fp32_param(torch.nn.Parameter(torch.zeros(2))),
        lambda: safe_get_full_fp32_param("not a parameter"),
        lambda: safe_set_full_grad(target, torch.full_like(value, float("inf"))),
        lambda: safe_set_local_grad(target, torch.zeros(mine.numel() + 1)),
        lambda: safe_set_full_optimizer_state(target, -value - 1, "exp_avg_sq"),  # a negative second moment
        lambda: safe_set_local_optimizer_state(target, torch.full_like(mine, -1.0), "exp_avg_sq"),
    ):
        try:
            call()
            hostile.append("accepted")
        except (ValueError, KeyError, TypeError) as err:
            hostile.append(f"{type(err).__name__}: {err}")

    # offload_states / reload_states: the next step matches a twin engine that never offloaded, bit for bit
    twin, *_ = deepspeed.initialize(model=make_model(frozen=FROZEN), config=config)
    for batch in batches[:2]:
        x, y = batch
        twin.backward(twin(x[rows], y[rows]))
        twin.step()
    engine.destroy()
    engine, *_ = deepspeed.initialize(model=make_model(frozen=FROZEN), config=config)
    for batch in batches[:2]:
        x, y = batch
        engine.backward(engine(x[rows], y[rows]))
        engine.step()
    storages = [t.untyped_storage() for t in engine.stack.states._tensors(OffloadStateTypeEnum.optim_states)]
    engine.optimizer.offload_states(include=[OffloadStateTypeEnum.optim_states], non_blocking=True)
    engine.offload_states()  # the rest, through the engine's name
    freed = all(s.nbytes() == 0 for s in storages)
    try:
        engine(batches[2][0][rows], batches[2][1][rows])
        refused = "accepted"
    except StatesOffloadedError as err:
        refused = str(err)
    engine.reload_states()
    x, y = batches[2]
    losses = []
    for e in (engine, twin):
        loss = e(x[rows], y[rows])
        e.backward(loss)
        e.step()
        losses.append(loss.item())
    same = all(
        torch.equal(a, b)
        for a, b in zip(
            engine.consolidated_state_dict(rank0_only=False).values(),
            twin.consolidated_state_dict(rank0_only=False).values(),
        )
    )
    engine.destroy()
    twin.destroy()
    return {
        "errors": errors,
        "set_ok": bool(set_ok),
        "grad_ok": bool(grad_ok),
        "hostile": hostile,
        "fragment_numel": mine.numel(),
        "freed": freed and len(storages) > 0,
        "refused": refused,
        "same_after_reload": same and losses[0] == losses[1],
    }


@pytest.fixture(scope="module")
def results():
    return run_distributed(access_worker, 2, timeout_s=400)


@pytest.mark.parametrize("label", list(CONFIGS))
def test_safe_get_and_set_match_the_reference_step(results, label):
    for per_rank in results:
        result = per_rank[label]
        assert result["errors"] == []
        assert result["set_ok"] and result["grad_ok"]
        wrong_shape, nan, key, fragment, stranger, not_param, inf_grad, grad_fragment, *negative = result["hostile"]
        assert wrong_shape.startswith("ValueError") and "shape" in wrong_shape
        assert nan.startswith("ValueError") and "NaN" in nan
        assert key.startswith("KeyError") and "momentum_buffer" in key and "exp_avg" in key
        assert fragment.startswith("ValueError") and "element" in fragment
        assert stranger.startswith("ValueError") and "no live engine" in stranger
        assert not_param.startswith("TypeError")
        assert inf_grad.startswith("ValueError") and "NaN or inf" in inf_grad
        assert grad_fragment.startswith("ValueError") and "element" in grad_fragment
        whole, local = negative  # a rank holding none of the parameter has no fragment to refuse
        assert whole.startswith("ValueError") and "negative 'exp_avg_sq'" in whole, whole
        assert "negative 'exp_avg_sq'" in local if result["fragment_numel"] else local == "accepted", local


@pytest.mark.parametrize("label", list(CONFIGS))
def test_offload_and_reload_states_round_trip_bit_exactly(results, label):
    for per_rank in results:
        result = per_rank[label]
        assert result["freed"]
        assert "reload_states" in result["refused"]
        assert result["same_after_reload"]
