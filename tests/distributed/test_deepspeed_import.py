"""A DeepSpeed checkpoint imported with `zeroshard convert --from-deepspeed` resumes in zeroshard: at the same
world size and stage, 2 more steps equal DeepSpeed's own 2 more steps (fixtures written by DeepSpeed 0.19.8 with
their continuation); at another stage and world size the weights and Adam moments load exactly. Checkpoints of
DeepSpeed's default optimizers (FusedAdam for "Adam" / "AdamW", DeepSpeedCPUAdam under offload_optimizer) resume
the client's way: `deepspeed.initialize` in compat mode with the very config DeepSpeed ran, then 3 more steps.
`load_checkpoint` also reads DeepSpeed's files directly (in memory, as the import reads them)."""

import json
from pathlib import Path

import pytest
import torch

from zeroshard.testing import run_distributed
from zeroshard.testing.fixtures import module_from_file

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "deepspeed_checkpoints"


def _fixture_module():
    """The fixtures' model, data and config (``shapes.py`` beside the script that wrote them)."""
    return module_from_file(FIXTURES / "shapes.py", "ds_fixture_shapes")


def resume(directory: str, case: str, stage: int) -> dict:
    """Load the imported ``case`` into a ``stage`` engine; the loaded weights and moments, then 2 steps."""
    import zeroshard

    shapes = _fixture_module()
    rank = zeroshard.comm.get_rank()
    config = shapes.config(stage, "fp32")
    torch.manual_seed(1)  # weights that differ from the checkpoint's until it loads
    engine, *_ = zeroshard.initialize(model=shapes.Tiny(), config=config)
    _, client = engine.load_checkpoint(directory)
    access = engine.param_access
    loaded = {
        name: (access.full_fp32_param(p).clone(), access.full_optimizer_state(p, "exp_avg").clone())
        for name, p in engine.module.named_parameters()
    }
    losses = []
    for x, y in shapes.batches(rank)[2:]:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    state = engine.consolidated_state_dict(rank0_only=False)
    engine.destroy()
    return {"loaded": loaded, "losses": losses, "state": state, "client": client, "steps": engine.global_steps}


DEFAULT_OPTIMIZER_CASES = [
    f"{optimizer}_stage{stage}_{dtype}"
    for optimizer in ("fused_adamw", "fused_adam", "cpuadam_adamw")
    for stage in (1, 2, 3)
    for dtype in ("fp32", "bf16")
]


def resume_as_deepspeed(directory: str, case: str) -> dict:
    """The client's path: ``import deepspeed`` (served by zeroshard), ``deepspeed.initialize`` with the config
    DeepSpeed wrote the checkpoint with (its default optimizer), ``load_checkpoint``, 3 more steps."""
    import deepspeed

    shapes = _fixture_module()
    _, facts = _expected(case)
    rank = deepspeed.comm.get_rank()
    torch.manual_seed(1)
    engine, *_ = deepspeed.initialize(model=shapes.Tiny(), config=facts["config"])
    _, client = engine.load_checkpoint(directory)
    access = engine.param_access
    loaded = {
        name: tuple(
            access.full_optimizer_state(p, key).clone() if key != "fp32" else access.full_fp32_param(p).clone()
            for key in ("fp32", "exp_avg", "exp_avg_sq")
        )
        for name, p in engine.module.named_parameters()
    }
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float32
    losses = []
    for x, y in shapes.batches(rank, 5)[2:]:
        loss = engine(x.to(dtype), y.to(dtype))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    state = {n: access.full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return {"loaded": loaded, "losses": losses, "state": state, "client": client, "steps": engine.global_steps}


def two_rank_worker(imported: dict) -> dict:
    import zeroshard

    zeroshard.install_as_deepspeed()
    out = {case: resume_as_deepspeed(imported[case], case) for case in DEFAULT_OPTIMIZER_CASES}

    out.update(
        {case: resume(imported[case], case, int(case[5])) for case in ("stage1_fp32", "stage2_fp32", "stage3_fp32")}
    )
    out["stage2_into_3"] = resume(imported["stage2_fp32"], "stage2_fp32", 3)
    out["direct"] = resume(str(FIXTURES / "stage2_fp32" / "ckpt"), "stage2_fp32", 2)  # DeepSpeed's own files
    return out


def one_rank_worker(imported: dict) -> dict:
    return {"stage3_into_0": resume(imported["stage3_fp32"], "stage3_fp32", 0)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    from zeroshard.checkpoint import convert_deepspeed_checkpoint

    base = tmp_path_factory.mktemp("imported")
    imported = {
        case: convert_deepspeed_checkpoint(str(FIXTURES / case / "ckpt"), str(base / case)).rsplit("/", 1)[0]
        for case in ("stage1_fp32", "stage2_fp32", "stage3_fp32", *DEFAULT_OPTIMIZER_CASES)
    }
    return {"two": run_distributed(two_rank_worker, 2, imported), "one": run_distributed(one_rank_worker, 1, imported)}


def _expected(case: str) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    return load_file(FIXTURES / case / "expected.safetensors"), json.loads(
        (FIXTURES / case / "expected.json").read_text()
    )


def _loaded_exactly(got: dict, case: str) -> None:
    tensors, _ = _expected(case)
    for name, (weight, exp_avg) in got["loaded"].items():
        assert torch.equal(weight, tensors[f"fp32.{name}"]), name
        assert torch.equal(exp_avg, tensors[f"exp_avg.{name}"]), name


@pytest.mark.parametrize("case", ["stage1_fp32", "stage2_fp32", "stage3_fp32", "direct"])
def test_resuming_an_imported_checkpoint_continues_as_deepspeed_does(runs, case):
    """``direct``: ``load_checkpoint`` on DeepSpeed's own files, read in memory as the import reads them."""
    from zeroshard.testing.parity import model_error

    key, case = case, "stage2_fp32" if case == "direct" else case
    tensors, facts = _expected(case)
    continued = {name: tensors[f"continued.{name}"] for name in facts["names"]}
    for rank, out in enumerate(runs["two"]):
        got = out[key]
        _loaded_exactly(got, case)
        assert got["client"] == facts["client_state"] and got["steps"] == 4
        for loss, want in zip(got["losses"], facts["continued_losses_per_rank"][rank]):
            assert abs(loss - want) <= 1e-5 * abs(want), (got["losses"], facts["continued_losses_per_rank"][rank])
        assert model_error(got["state"], continued) <= 1e-5


def test_an_imported_checkpoint_loads_at_another_stage_and_world_size(runs):
    for out in runs["two"]:
        _loaded_exactly(out["stage2_into_3"], "stage2_fp32")
    _loaded_exactly(runs["one"][0]["stage3_into_0"], "stage3_fp32")


@pytest.mark.parametrize("case", DEFAULT_OPTIMIZER_CASES)
def test_deepspeeds_default_optimizer_resumes_through_deepspeed_initialize(runs, case):
    """FusedAdam / DeepSpeedCPUAdam checkpoints (group keys bias_correction, step; the update rule from the
    config) load with DeepSpeed's own config, moments bitwise, and 3 more steps equal DeepSpeed's (1e-5)."""
    from zeroshard.testing.parity import model_error

    tensors, facts = _expected(case)
    assert facts["optimizer_class"] == ("DeepSpeedCPUAdam" if case.startswith("cpuadam") else "FusedAdam")
    continued = {name: tensors[f"continued.{name}"] for name in facts["names"]}
    for rank, out in enumerate(runs["two"]):
        got = out[case]
        for name, (weight, exp_avg, exp_avg_sq) in got["loaded"].items():
            assert torch.equal(weight, tensors[f"fp32.{name}"]), name
            assert torch.equal(exp_avg, tensors[f"exp_avg.{name}"]), name
            assert torch.equal(exp_avg_sq, tensors[f"exp_avg_sq.{name}"]), name
        assert got["client"] == facts["client_state"] and got["steps"] == 5
        for loss, want in zip(got["losses"], facts["continued_losses_per_rank"][rank], strict=True):
            assert abs(loss - want) <= 1e-5 * abs(want), (got["losses"], facts["continued_losses_per_rank"][rank])
        assert model_error(got["state"], continued) <= 1e-5
