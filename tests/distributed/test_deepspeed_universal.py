"""DeepSpeed's universal checkpoints, both ways. In: folders DeepSpeed 0.19.8's ``ds_to_universal`` wrote (stages
1-3, fp32 and bf16, its default optimizer FusedAdam) resume through ``deepspeed.initialize`` in compat mode with
``"checkpoint": {"load_universal": true}``, the client's path: fp32 masters and Adam moments bitwise equal to the
folder's files, and 2 more steps equal DeepSpeed's own 2 more steps after its universal load, at world 1 and 2
(fp32 1e-6, bf16 1e-3 relative); at world 4 and at stages 0-3 the state loads bitwise. Out: a zeroshard checkpoint
written with ``zeroshard convert --to deepspeed-universal`` comes back exactly, for Adam and for optimizers whose
state is not Adam's."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from zeroshard.testing import run_distributed
from zeroshard.testing.fixtures import module_from_file
from zeroshard.testing.parity import model_error

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "deepspeed_checkpoints"
CASES = [f"fused_adamw_stage{stage}_{dtype}" for stage in (1, 2, 3) for dtype in ("fp32", "bf16")]


def _fixture_module():
    return module_from_file(FIXTURES / "shapes.py", "ds_fixture_shapes")


def _universal_config(case: str, stage: int | None = None) -> dict:
    config = json.loads((FIXTURES / case / "expected.json").read_text())["config"]
    if stage is not None:
        config["zero_optimization"]["stage"] = stage
    return {**config, "checkpoint": {"load_universal": True}}


def resume_universal(case: str, stage: int | None = None, steps: int = 2) -> dict:
    """``import deepspeed`` (zeroshard), the config DeepSpeed ran plus load_universal, ``load_checkpoint(dir)``:
    what loaded (fp32, exp_avg, exp_avg_sq per parameter), then ``steps`` more steps on this rank's batches."""
    import deepspeed

    shapes = _fixture_module()
    rank = deepspeed.comm.get_rank()
    torch.manual_seed(1)  # weights that differ from the checkpoint's until it loads
    engine, *_ = deepspeed.initialize(model=shapes.Tiny(), config=_universal_config(case, stage))
    path, client = engine.load_checkpoint(str(FIXTURES / case / "ckpt"))
    access = engine.param_access
    loaded = {
        name: [access.full_fp32_param(p).clone()]
        + [access.full_optimizer_state(p, key).clone() for key in ("exp_avg", "exp_avg_sq")]
        for name, p in engine.module.named_parameters()
    }
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float32
    losses = []
    for x, y in shapes.batches(rank, 2 + steps)[2:]:
        loss = engine(x.to(dtype), y.to(dtype))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    weights = {name: access.full_fp32_param(p).clone() for name, p in engine.module.named_parameters()}
    out = {"path": path, "client": client, "loaded": loaded, "losses": losses, "steps": engine.global_steps}
    engine.destroy()
    return {**out, "weights": weights} if steps else out


def refused_load() -> str:
    """A universal folder whose last parameter's file is bad: the load is refused by name and the engine keeps
    every weight and counter it had (the folder is read and checked whole before anything is restored)."""
    import shutil
    import tempfile

    import deepspeed

    shapes = _fixture_module()
    case = "fused_adamw_stage2_fp32"
    with tempfile.TemporaryDirectory() as directory:
        shutil.copytree(FIXTURES / case / "ckpt" / "global_step2_universal", f"{directory}/global_step2_universal")
        Path(directory, "latest_universal").write_text("global_step2_universal")
        torch.save({"param": -torch.ones(3)}, f"{directory}/global_step2_universal/zero/down.bias/exp_avg_sq.pt")
        engine, *_ = deepspeed.initialize(model=shapes.Tiny(), config=_universal_config(case))
        before = {n: engine.param_access.full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}
        try:
            engine.load_checkpoint(directory)
            message = "loaded"
        except Exception as error:  # noqa: BLE001 - the message is what the test checks
            message = f"{type(error).__name__}: {error}"
        for name, p in engine.module.named_parameters():
            assert torch.equal(engine.param_access.full_fp32_param(p), before[name]), name
        assert engine.global_steps == 0
        engine.destroy()
    plain = {k: v for k, v in _universal_config(case).items() if k != "checkpoint"}
    engine, *_ = deepspeed.initialize(model=shapes.Tiny(), config=plain)
    try:
        engine.load_checkpoint(str(FIXTURES / case / "ckpt"), tag="global_step2_universal")
        without = "loaded"
    except Exception as error:  # noqa: BLE001 - the message is what the test checks
        without = f"{type(error).__name__}: {error}"
    engine.destroy()
    return message, without


def world_worker(world: int) -> dict:
    import zeroshard

    zeroshard.install_as_deepspeed()
    out = {}
    if world in (1, 2):  # DeepSpeed's own continuation exists at these sizes: 2 more steps at the saved stage
        out.update({case: resume_universal(case) for case in CASES})
    for case in CASES:  # every stage (the saved one too at world 4): the state must load exactly
        saved = int(case.split("stage")[1][0])
        stages = [s for s in (0, 1, 2, 3) if world == 4 or s != saved]
        out.update({f"{case}@{stage}": resume_universal(case, stage, steps=0) for stage in stages})
    if world == 1:
        out["refused"] = refused_load()
    return out


@pytest.fixture(scope="module")
def runs() -> dict:
    return {world: run_distributed(world_worker, world, world) for world in (1, 2, 4)}


def _folder_tensors(case: str) -> dict:
    """The universal folder's own files, read with zeroshard's restricted reader (what must load bitwise)."""
    from zeroshard.checkpoint import read_deepspeed_file

    zero = FIXTURES / case / "ckpt" / "global_step2_universal" / "zero"
    out = {}
    for folder in zero.iterdir():
        if folder.is_dir():
            for key in ("fp32", "exp_avg", "exp_avg_sq"):
                data = read_deepspeed_file(str(folder / f"{key}.pt"))
                out[(folder.name, key)] = (data["param"] if isinstance(data, dict) else data).float()
    return out


def _loaded_bitwise(got: dict, case: str) -> None:
    files = _folder_tensors(case)
    for name, values in got["loaded"].items():
        for key, value in zip(("fp32", "exp_avg", "exp_avg_sq"), values):
            assert torch.equal(value.reshape(-1), files[(name, key)].reshape(-1)), (case, name, key)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", CASES)
def test_a_universal_folder_resumes_as_deepspeed_resumes_it(runs, case, world):
    record = json.loads((FIXTURES / case / "universal.json").read_text())
    facts = json.loads((FIXTURES / case / "expected.json").read_text())
    tolerance = 1e-3 if case.endswith("bf16") else 1e-6
    for rank, out in enumerate(runs[world]):
        got = out[case]
        assert got["path"].endswith("global_step2_universal")
        _loaded_bitwise(got, case)
        assert got["client"] == facts["client_state"] and got["steps"] == record["global_steps_after"]
        want = record["losses"][str(world)][rank]
        for loss, expected in zip(got["losses"], want, strict=True):
            assert abs(loss - expected) <= tolerance * abs(expected), (case, world, got["losses"], want)
        theirs = load_file(FIXTURES / case / f"universal_{world}.safetensors")  # DeepSpeed's weights after them
        assert model_error(got["weights"], theirs) <= tolerance, (case, world, model_error(got["weights"], theirs))


def test_a_refused_universal_load_changes_nothing(runs):
    message, without = runs[1][0]["refused"]
    assert message.startswith("CheckpointError") and "down.bias/exp_avg_sq.pt: negative values" in message
    assert 'is a DeepSpeed universal checkpoint: set "checkpoint": {"load_universal": true}' in without, without


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("case", CASES)
def test_a_universal_folder_loads_exactly_at_every_stage_and_world_size(runs, case, world):
    for out in runs[world]:
        for stage in (0, 1, 2, 3):
            if f"{case}@{stage}" in out:
                _loaded_bitwise(out[f"{case}@{stage}"], case)
            else:
                _loaded_bitwise(out[case], case)  # the saved stage, checked with its continuation


# -- out: zeroshard -> universal ------------------------------------------------------------------------------
OPTIMIZERS = {  # each optimizer's own state keys must come back, not Adam's
    "AdamW": {"lr": 1e-2, "weight_decay": 0.01},
    "Muon": {"lr": 1e-2, "momentum": 0.9},
    "Lion": {"lr": 1e-3, "weight_decay": 0.01},
    "Adagrad": {"lr": 1e-2},
    "SGD": {"lr": 1e-2, "momentum": 0.9},
    "Lamb": {"lr": 1e-2},
    "OneBitAdam": {"lr": 1e-2, "freeze_step": 1},
}


def _config(optimizer: str, stage: int) -> dict:
    shapes = _fixture_module()
    config = shapes.config(stage, "fp32", torch_adam=False)  # DeepSpeed's default optimizer path for AdamW
    config["optimizer"] = {"type": optimizer, "params": OPTIMIZERS[optimizer]}
    return config


def resume_exported(base: str, make_model, config: dict, export: bool = True):
    """Rank 0 exports ``base/native`` to ``base/universal`` (unless ``export`` is False: done before); every rank then
    builds ``make_model()`` (other initial weights: seed 1) with ``config`` and load_universal, and loads the export.
    Returns (engine, client state)."""
    import zeroshard
    from zeroshard.checkpoint import export_universal_checkpoint

    if zeroshard.comm.get_rank() == 0 and export:
        export_universal_checkpoint(f"{base}/native", f"{base}/universal")
    torch.distributed.barrier()
    torch.manual_seed(1)
    engine, *_ = zeroshard.initialize(model=make_model(), config={**config, "checkpoint": {"load_universal": True}})
    _, client = engine.load_checkpoint(f"{base}/universal")
    return engine, client


def export_worker(base: str) -> dict:
    """Per optimizer: train 2 steps, save, export to a universal folder, resume it (load_universal) at another
    stage, save again; both checkpoints are compared on disk. Also the losses of 2 more steps (AdamW)."""
    import zeroshard

    shapes = _fixture_module()
    rank = zeroshard.comm.get_rank()
    losses = {}
    for optimizer in OPTIMIZERS:
        torch.manual_seed(0)
        engine, *_ = zeroshard.initialize(model=shapes.Tiny(), config=_config(optimizer, 2))
        data = shapes.batches(rank, 4)
        for x, y in data[:2]:
            engine.backward(engine(x, y))
            engine.step()
        engine.save_checkpoint(f"{base}/{optimizer}/native", client_state={"epoch": 3})
        losses[optimizer] = []
        for x, y in data[2:]:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses[optimizer].append(loss.item())
        engine.destroy()
        engine, client = resume_exported(f"{base}/{optimizer}", shapes.Tiny, _config(optimizer, 3))
        assert client == {"epoch": 3}, client
        engine.save_checkpoint(f"{base}/{optimizer}/again", tag="global_step2")
        engine.destroy()
    return {**losses, "frozen": frozen_round_trip(base), "stale": stale_latest_universal(base)}


def stale_latest_universal(base: str) -> tuple:
    """A save with load_universal writes latest_universal; a later plain save into the same folder keeps it current,
    so a resume with load_universal takes the newest step (before: the older one, silently)."""
    import zeroshard

    shapes = _fixture_module()
    data = shapes.batches(zeroshard.comm.get_rank(), 2)
    universal = {**_config("AdamW", 2), "checkpoint": {"load_universal": True}}
    engine, *_ = zeroshard.initialize(model=shapes.Tiny(), config=universal)
    engine.backward(engine(*data[0]))
    engine.step()
    engine.save_checkpoint(f"{base}/stale")
    engine.destroy()
    engine, *_ = zeroshard.initialize(model=shapes.Tiny(), config=_config("AdamW", 2))
    engine.load_checkpoint(f"{base}/stale")
    engine.backward(engine(*data[1]))
    engine.step()
    engine.save_checkpoint(f"{base}/stale")  # a plain save: no load_universal in this run's config
    engine.destroy()
    named = open(f"{base}/stale/latest_universal").read()
    engine, *_ = zeroshard.initialize(model=shapes.Tiny(), config=universal)
    engine.load_checkpoint(f"{base}/stale")
    steps = engine.global_steps
    engine.destroy()
    return named, steps


def frozen_round_trip(base: str) -> bool:
    """A fine-tune's frozen parameters (here the LayerNorm) travel with the export and come back exactly."""
    import zeroshard

    shapes = _fixture_module()

    def model():
        tiny = shapes.Tiny()
        tiny.norm.requires_grad_(False)
        with torch.no_grad():
            tiny.norm.weight.add_(torch.randn(10))  # of this run's seed, so a value not restored shows
        return tiny

    torch.manual_seed(0)
    engine, *_ = zeroshard.initialize(model=model(), config=_config("AdamW", 2))
    for x, y in shapes.batches(zeroshard.comm.get_rank(), 2):
        engine.backward(engine(x, y))
        engine.step()
    engine.save_checkpoint(f"{base}/frozen/native")
    saved = {n: engine.param_access.full_fp32_param(p).clone() if p.requires_grad else p.detach().clone()
             for n, p in engine.module.named_parameters()}  # fmt: skip
    engine.destroy()
    same = []
    for stage in (1, 3):  # stage 3 shards the frozen parameters: they load through its frozen flat groups
        engine, _ = resume_exported(f"{base}/frozen", model, _config("AdamW", stage), export=stage == 1)
        loaded = engine.consolidated_state_dict(rank0_only=False)
        engine.destroy()
        same.append(all(torch.equal(loaded[n], saved[n]) for n in saved))
    return all(same)


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("exported")
    return {"base": base, "losses": run_distributed(export_worker, 2, str(base))}


def test_frozen_parameters_travel_through_the_universal_format(exported):
    assert all(out["frozen"] for out in exported["losses"])


def test_latest_universal_follows_every_save_once_it_exists(exported):
    assert all(out["stale"] == ("global_step2", 2) for out in exported["losses"]), exported["losses"][0]["stale"]


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_zeroshard_to_universal_to_zeroshard_is_exact_for_every_optimizer(exported, optimizer):
    from zeroshard.checkpoint.reading import Sources, read_manifest, read_parameter

    first, second = (read_manifest(str(exported["base"] / optimizer / k / "global_step2")) for k in ("native", "again"))
    assert second["optimizer"]["type"] == first["optimizer"]["type"]
    assert first["optimizer"]["type"] == {"Muon": "MuonWithAuxAdam"}.get(optimizer, optimizer)
    assert second["optimizer"]["param_groups"] == first["optimizer"]["param_groups"]
    a = Sources(str(exported["base"] / optimizer / "native" / "global_step2"), first)
    b = Sources(str(exported["base"] / optimizer / "again" / "global_step2"), second)
    universal = exported["base"] / optimizer / "universal"
    assert (universal / "latest_universal").read_text() == "global_step2_universal"
    # saved with load_universal set: 'latest_universal' names the zeroshard checkpoint itself
    assert (exported["base"] / optimizer / "again" / "latest_universal").read_text() == "global_step2"
    for name in first["params"]:
        (keys, scalars), (again, again_scalars) = (_optimizer_state_of(m, name) for m in (first, second))
        assert keys == again and keys and scalars == again_scalars, (name, keys, again, scalars, again_scalars)
        for prefix in ["master", *(f"optim.{k}" for k in keys)]:
            assert torch.equal(read_parameter(a, name, prefix), read_parameter(b, name, prefix)), (name, prefix)
        files = {p.name for p in (universal / "global_step2_universal" / "zero" / name).iterdir()}
        assert files == {"fp32.pt", *(f"{k}.pt" for k in keys), *(["step.pt"] if "step" in scalars else [])}


def _optimizer_state_of(manifest: dict, name: str) -> tuple[list[str], dict]:
    """The state keys and scalars of the flat group that holds parameter ``name``."""
    flat = manifest["optimizer"]["flat_groups"][int(manifest["params"][name]["pieces"][0][1][2:])]
    return flat["state_keys"], flat["scalars"]


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_resumes_an_exported_folder(exported, tmp_path, stage):
    """Real DeepSpeed (from ZEROSHARD_TEST_DEEPSPEED, a directory put on PYTHONPATH; never this environment)
    resumes the AdamW export (saved at stage 2) at 2 ranks, stage 2 and 3, with its default optimizer
    (FusedAdam); its 2 more steps equal zeroshard's."""
    import os
    import subprocess
    import sys

    where = os.environ.get("ZEROSHARD_TEST_DEEPSPEED")
    if not where:
        pytest.skip(
            "set ZEROSHARD_TEST_DEEPSPEED to a directory holding DeepSpeed (pip install --target DIR deepspeed)"
        )
    script = Path(__file__).parent / "scripts" / "deepspeed_resume_universal.py"
    out = tmp_path / "ds.json"
    env = {**os.environ, "PYTHONPATH": where, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    universal = str(exported["base"] / "AdamW" / "universal")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
               universal, json.dumps(_config("AdamW", stage)), "2", str(out)]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = json.loads(out.read_text())
    assert theirs["global_steps"] == 4 and theirs["client"]["epoch"] == 3
    for rank, ours in enumerate(exported["losses"]):
        for mine, deepspeeds in zip(ours["AdamW"], theirs["losses"][rank], strict=True):
            assert abs(mine - deepspeeds) <= 1e-6 * abs(deepspeeds), (ours["AdamW"], theirs["losses"][rank])


def tensor_parallel_worker(base: str) -> dict:
    """A universal folder loads at tensor-parallel degree 2: a Llama trained at TP=1 x DP=2, exported, resumed at
    TP=2 with load_universal; the consolidated weights and Adam moments equal the ones saved."""
    import zeroshard
    from zeroshard.testing.hf import tiny_causal_lm

    def config(tp: int) -> dict:
        return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": 1},
                "tensor_parallel": {"autotp_size": tp}}  # fmt: skip

    torch.manual_seed(0)
    engine, *_ = zeroshard.initialize(model=tiny_causal_lm("llama"), config=config(1))
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(zeroshard.comm.get_rank()))
    for _ in range(2):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.save_checkpoint(f"{base}/native")
    saved = {n: (engine.param_access.full_fp32_param(p).clone(),
                 engine.param_access.full_optimizer_state(p, "exp_avg").clone())
             for n, p in engine.module.named_parameters()}  # fmt: skip
    engine.destroy()
    engine, _ = resume_exported(base, lambda: tiny_causal_lm("llama"), config(2))
    whole = engine.consolidated_state_dict(rank0_only=False)
    splits, rank = engine.tensor_splits, engine.mesh.tensor.rank
    out = {"tp": engine.autotp_size(), "splits": len(splits),
           "weights": all(torch.equal(whole[n].float(), w) for n, (w, _) in saved.items())}  # fmt: skip
    out["moments"] = all(  # this rank's tensor-parallel piece of each moment, cut from the saved whole one
        torch.equal(engine.param_access.full_optimizer_state(p, "exp_avg"),
                    splits[n].piece(saved[n][1], rank) if n in splits else saved[n][1])
        for n, p in engine.module.named_parameters()
    )  # fmt: skip
    engine.destroy()
    return out


def test_a_universal_folder_loads_at_tensor_parallel_degree_2(tmp_path):
    for out in run_distributed(tensor_parallel_worker, 2, str(tmp_path)):
        assert out["tp"] == 2 and out["splits"] > 0 and out["weights"] and out["moments"], out
