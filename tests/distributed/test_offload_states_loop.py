"""The OpenRLHF loop around ``offload_states``: train, save every few steps, offload around a forward-only
"generation", reload. Nothing may be lost: the run is bit-identical to the same run without offload, and every
checkpoint (saved while the states were on the host, or before an offload) loads into a fresh engine equal to the
engine's state when it was saved.

Before the fix a save while offloaded wrote zeros (or died with SIGSEGV at 2 ranks), and any save made every later
``offload_states`` fail half-way ("Trying to resize storage that is not resizable": the writer read the state
through ``.numpy()``, which pins a storage's size for good).

One spawn of 2 ranks runs stages 2 and 3 (fp32 and bf16; a frozen parameter, so stage 3 has a frozen flat group).
"""

from __future__ import annotations

import os

import pytest
import torch

from zeroshard.testing import run_distributed
from zeroshard.testing.parity import ParityCase, make_batches, make_model

FROZEN = ("wpe.weight",)
CASES = {
    "stage2-fp32": ParityCase(stage=2),
    "stage3-fp32": ParityCase(stage=3, zero=(("stage3_param_persistence_threshold", 0),)),
    "stage3-bf16": ParityCase(stage=3, dtype="bf16", zero=(("stage3_param_persistence_threshold", 0),)),
    "stage2-bf16": ParityCase(stage=2, dtype="bf16"),
}
STEPS, SAVE_EVERY = 10, 3
# what OpenRLHF offloads around generation (openrlhf/utils/deepspeed/deepspeed_utils.py): all but lp_params
GENERATION = ["optim_states", "contiguous_grad_buffer", "hp_params", "lp_grads"]


def _state(engine) -> dict[str, torch.Tensor]:
    """Every trainable parameter's fp32 master and optimizer state, whole (collectives: every rank calls it)."""
    out = {}
    for name, param in engine.module.named_parameters():
        if param.requires_grad:
            out[f"{name}.master"] = engine.param_access.full_fp32_param(param)
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"{name}.{key}"] = engine.param_access.full_optimizer_state(param, key)
    out.update({f"weights.{k}": v for k, v in engine.consolidated_state_dict(rank0_only=False).items()})
    return out


def _refusals(engine, x, y, save_dir: str, tag: str) -> dict[str, str]:
    from zeroshard.zero.state_offload import StatesOffloadedError

    param = next(p for p in engine.module.parameters() if p.requires_grad)
    out = {}
    for label, call in {
        "forward": lambda: engine(x, y),
        "get": lambda: engine.param_access.full_fp32_param(param),
        "set": lambda: engine.param_access.set_local_fp32_param(param, torch.zeros(1)),
        "load": lambda: engine.load_checkpoint(save_dir, tag=tag),
        "step": engine.step,
    }.items():
        try:
            call()
            out[label] = "accepted"
        except StatesOffloadedError as err:
            out[label] = str(err)
    return out


def _run(case: ParityCase, offload: bool, save_dir: str | None) -> tuple[list[float], dict, dict]:
    import zeroshard

    rank, world = zeroshard.comm.get_rank(), zeroshard.comm.get_world_size()
    engine, *_ = zeroshard.initialize(model=make_model(frozen=FROZEN), config=case.config())
    rows = slice(rank * case.micro_batch, (rank + 1) * case.micro_batch)
    batches = make_batches(STEPS, case.micro_batch * world)
    losses, saved, refusals = [], {}, {}
    for step, (x, y) in enumerate(batches, start=1):
        loss = engine(x[rows], y[rows])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if offload:
            engine.offload_states(include=GENERATION)
            with torch.no_grad():  # the "generation": a forward on the compute parameters, still on the device
                engine.eval()
                engine(x[rows], y[rows])
                engine.train()
            if step % SAVE_EVERY == 0:
                engine.offload_states()  # the rest too: the save reads everything from the host copies
                saved[f"s{step}"] = engine.save_checkpoint(save_dir, tag=f"s{step}")
                if step == SAVE_EVERY:  # every use that needs a state on the device is refused by name
                    refusals = _refusals(engine, x[rows], y[rows], save_dir, f"s{step}")
            engine.reload_states()
        elif save_dir is not None and step % SAVE_EVERY == 0:
            saved[f"s{step}"] = engine.save_checkpoint(save_dir, tag=f"s{step}")
        if step % SAVE_EVERY == 0:
            saved[f"s{step}.state"] = _state(engine)
    final = _state(engine)
    engine.destroy()
    return losses, {"saved": saved, "final": final}, refusals


def loop_worker(directory: str) -> dict:
    import zeroshard

    results = {}
    for label, case in CASES.items():
        save_dir = os.path.join(directory, label)
        losses, run, refusals = _run(case, offload=True, save_dir=save_dir)
        twin_losses, twin, _ = _run(case, offload=False, save_dir=None)
        loaded = {}
        for tag in (f"s{s}" for s in range(SAVE_EVERY, STEPS + 1, SAVE_EVERY)):
            fresh, *_ = zeroshard.initialize(model=make_model(seed=7, frozen=FROZEN), config=case.config())
            fresh.load_checkpoint(save_dir, tag=tag)
            expected = run["saved"][f"{tag}.state"]
            state = _state(fresh)
            loaded[tag] = all(torch.equal(state[k], expected[k]) for k in expected) and len(state) == len(expected)
            fresh.destroy()
        same_state = all(torch.equal(run["final"][k], twin["final"][k]) for k in twin["final"])
        results[label] = {
            "losses_equal": losses == twin_losses,
            "state_equal": same_state,
            "saved_state_equal_to_twin": all(
                torch.equal(run["saved"][k][n], twin["saved"][k][n]) for k in twin["saved"] for n in twin["saved"][k]
            ),
            "loaded": loaded,
            "refusals": refusals,
        }
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(loop_worker, 2, str(tmp_path_factory.mktemp("offload-loop")), timeout_s=500)


@pytest.mark.parametrize("label", list(CASES))
def test_offload_loop_is_bit_identical_to_the_run_without_offload(results, label):
    for rank_result in results:
        got = rank_result[label]
        assert got["losses_equal"] and got["state_equal"] and got["saved_state_equal_to_twin"], got


@pytest.mark.parametrize("label", list(CASES))
def test_every_checkpoint_saved_around_offload_loads_equal_to_the_engine_state(results, label):
    for rank_result in results:
        assert rank_result[label]["loaded"] == {"s3": True, "s6": True, "s9": True}


@pytest.mark.parametrize("label", list(CASES))
def test_uses_needing_the_device_state_are_refused_by_name_while_offloaded(results, label):
    refusals = results[0][label]["refusals"]
    assert set(refusals) == {"forward", "get", "set", "load", "step"}
    for call, message in refusals.items():
        assert "offloaded to the host" in message and "reload_states()" in message, (call, message)
    assert refusals["forward"].startswith("engine.forward") and "lp_params" in refusals["forward"]
    assert refusals["get"].startswith("engine.param_access")
    assert refusals["load"].startswith("engine.load_checkpoint")
