"""DeepSpeed's pipeline checkpoints (layer files, one model-states file per stage, ZeRO-1 partitions per stage and
data-parallel rank; fixtures written by DeepSpeed 0.19.8's pipeline engine at PP2 x DP2, fp32 and bf16, with its own
continuation) load into zeroshard's pipeline engine: ``load_checkpoint`` on DeepSpeed's directory, at the same
layout, at PP4 and in one process, gives every fp32 master and Adam moment bit for bit, the tied embedding once, the
step, the scheduler and the client state; 3 more steps continue as DeepSpeed continued. ``zeroshard convert
--from-deepspeed`` writes the same model. Back: what zeroshard saved after the load, exported with
``--pipeline_stages``, is DeepSpeed's layer files and stage states beside a universal folder, which DeepSpeed 0.19.8
resumes at PP2 x DP2 and PP4 and continues as its own run did. Hostile copies (a missing or foreign layer file, a
stage's partition missing, a stage of another run) are named errors; the files are read with the restricted
unpickler, so nothing in them runs."""

import json
import shutil
from pathlib import Path
from typing import Optional

import pytest
import torch

from zeroshard.testing import run_distributed
from zeroshard.testing.fixtures import module_from_file
from zeroshard.testing.hostile import CodeRunningPickle

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "deepspeed_pipe_checkpoints"
CASES = ("pp2_dp2_fp32", "pp2_dp2_bf16")
GAS = 4  # the fixtures' micro-batches per data-parallel rank and step (8 per step in all)


def _layers():
    return module_from_file(FIXTURES / "layers.py", "ds_pipe_fixture_layers")


def _expected(case: str) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    return load_file(FIXTURES / case / "expected.safetensors"), json.loads(
        (FIXTURES / case / "expected.json").read_text()
    )


def resume(case: str, stages: int, save_to: Optional[str] = None) -> dict:
    """zeroshard's pipeline engine on the fixture's model at ``stages`` stages (the config DeepSpeed ran), loading
    DeepSpeed's own directory; what it loaded, then 3 more steps of the same global batches. ``save_to``: saved
    there (tag ``loaded``) right after the load, for the export back to DeepSpeed."""
    import zeroshard
    from zeroshard.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    layers = _layers()
    _, facts = _expected(case)
    torch.manual_seed(1)  # weights that differ from the checkpoint's until it loads
    module = PipelineModule(
        layers.layer_specs(LayerSpec, TiedLayerSpec), num_stages=stages, loss_fn=layers.cross_entropy
    )
    data_parallel = zeroshard.comm.get_world_size() // stages
    config = {**facts["config"], "gradient_accumulation_steps": 2 * GAS // data_parallel}  # the same global batch
    engine, *_ = zeroshard.initialize(model=module, config=config)
    _, client = engine.load_checkpoint(str(FIXTURES / case / "ckpt"))
    if save_to is not None:
        engine.save_checkpoint(save_to, tag="loaded", client_state=client)
    access = engine.param_access
    loaded = {
        name: tuple(access.full_fp32_param(p).clone() if key == "fp32" else access.full_optimizer_state(p, key).clone()
                    for key in ("fp32", "exp_avg", "exp_avg_sq"))
        for name, p in module.named_parameters()
    }  # fmt: skip
    out = {"loaded": loaded, "client": client, "steps": engine.global_steps, "lr": engine.get_lr()}
    dp, gas = engine.grid.get_data_parallel_rank(), config["gradient_accumulation_steps"]
    out["losses"] = [
        engine.train_batch(iter(step[dp * gas : (dp + 1) * gas])).item() for step in layers.batches(5, 2 * GAS)[2:]
    ]
    out["continued"] = {name: access.full_fp32_param(p).clone() for name, p in module.named_parameters()}
    engine.destroy()
    return out


def four_rank_worker(save_to: str) -> dict:
    return {case: {stages: resume(case, stages, save_to if (case, stages) == (CASES[0], 2) else None)
                   for stages in (2, 4)} for case in CASES}  # fmt: skip


def one_process_worker() -> dict:
    return {case: {1: resume(case, 1)} for case in CASES}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("zeroshard_pipeline")


@pytest.fixture(scope="module")
def runs(saved) -> dict:
    four = run_distributed(four_rank_worker, 4, str(saved), timeout_s=600)
    return {"four": four, "one": run_distributed(one_process_worker, 1)}


@pytest.mark.parametrize("stages", [2, 4, 1])
@pytest.mark.parametrize("case", CASES)
def test_deepspeeds_pipeline_checkpoint_loads_exactly_and_continues_as_deepspeed(runs, case, stages):
    """At DeepSpeed's layout (PP2 x DP2), at PP4 and in one process (one stage): the same model."""
    tensors, facts = _expected(case)
    within = 1e-6 if case.endswith("fp32") else 2e-2  # bf16 compute: DeepSpeed's and zeroshard's kernels round apart
    for rank, result in enumerate(runs["one" if stages == 1 else "four"]):
        got = result[case][stages]
        assert got["steps"] == 2 and got["client"] == facts["client_state"], (got["steps"], got["client"])
        assert got["lr"] == facts["lrs"], got["lr"]
        assert got["loaded"], rank
        for name, (master, exp_avg, exp_avg_sq) in got["loaded"].items():
            assert torch.equal(master, tensors[f"fp32.{name}"]), name
            assert torch.equal(exp_avg, tensors[f"exp_avg.{name}"]), name
            assert torch.equal(exp_avg_sq, tensors[f"exp_avg_sq.{name}"]), name
        for loss, want in zip(got["losses"], facts["continued_losses"], strict=True):
            assert abs(loss - want) <= within * abs(want), (got["losses"], facts["continued_losses"])
        for name, value in got["continued"].items():
            torch.testing.assert_close(value, tensors[f"continued.{name}"], rtol=within, atol=within, msg=name)


@pytest.mark.parametrize("stages", [2, 4])
def test_the_export_back_writes_deepspeeds_pipeline_files(runs, saved, tmp_path, stages):
    """``zeroshard convert CK OUT --to deepspeed-universal --pipeline_stages N`` on the checkpoint zeroshard saved
    after loading DeepSpeed's: the universal folder, each layer's tensors in its own file under its own names (the
    tied embedding once, at its first index; the parameterless layers' files empty), one engine state per stage."""
    from zeroshard.checkpoint import export_universal_checkpoint
    from zeroshard.checkpoint.deepspeed_record import read_deepspeed_file

    tensors, _ = _expected(CASES[0])
    folder = Path(export_universal_checkpoint(str(saved), str(tmp_path), tag="loaded", pipeline_stages=stages))
    files = sorted(p.name for p in folder.glob("layer_*-model_states.pt"))
    mp_ranks = sorted(p.name for p in folder.glob("mp_rank_*_model_states.pt"))
    assert mp_ranks == [f"mp_rank_{s:02d}_model_states.pt" for s in range(stages)]
    assert not (folder / "zero_pp_rank_0_mp_rank_00_model_states.pt").exists()
    for name in mp_ranks:
        state = read_deepspeed_file(str(folder / name))
        assert state["module"] is None and state["mp_world_size"] == stages and state["global_steps"] == 2
    seen = set()
    for name in files:
        index = int(name.split("_")[1].split("-")[0])
        for key, value in read_deepspeed_file(str(folder / name)).items():
            full = f"{index}.{key}" if f"fp32.{index}.{key}" in tensors else f"tied_modules.embed.{key}"
            assert torch.equal(value.float(), tensors[f"fp32.{full}"]), (name, key)
            seen.add(full)
    assert seen == {n.removeprefix("fp32.") for n in tensors if n.startswith("fp32.")}
    assert (folder / "zero" / "tied_modules.embed.weight" / "exp_avg.pt").exists()


def test_the_export_back_refuses_what_it_cannot_write(runs, saved, tmp_path):
    """Stage counts that are not one, a checkpoint that is no pipeline's, a manifest whose layer files were edited:
    named errors, nothing written."""
    from zeroshard.checkpoint import CheckpointError, export_universal_checkpoint

    for bad in (0, True, "2", 5000, 8):
        with pytest.raises(CheckpointError, match="pipeline_stages"):
            export_universal_checkpoint(str(saved), str(tmp_path / "a"), tag="loaded", pipeline_stages=bad)
    edited = tmp_path / "edited"
    shutil.copytree(saved, edited)
    manifest = json.loads((edited / "loaded" / "manifest.json").read_text())
    manifest["pipeline"]["layer_files"][0] = [99, ""]
    (edited / "loaded" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="fails its checksum"):
        export_universal_checkpoint(str(edited), str(tmp_path / "b"), tag="loaded", pipeline_stages=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["edited"]


@pytest.mark.parametrize("stages", [2, 4])
def test_deepspeed_resumes_the_export_and_continues_as_its_own_run(runs, saved, tmp_path, stages):
    """Real DeepSpeed 0.19.8 (ZEROSHARD_TEST_DEEPSPEED: a directory holding it, put on PYTHONPATH; never this
    environment) builds the fixture's pipeline at ``stages`` stages, resumes the export with ``load_universal`` and
    trains 3 steps: its losses equal those of its own run continuing within 1e-6."""
    import json
    import os
    import subprocess
    import sys

    where = os.environ.get("ZEROSHARD_TEST_DEEPSPEED")
    if not where:
        pytest.skip(
            "set ZEROSHARD_TEST_DEEPSPEED to a directory holding DeepSpeed (pip install --target DIR deepspeed)"
        )
    from zeroshard.checkpoint import export_universal_checkpoint

    export_universal_checkpoint(str(saved), str(tmp_path / "ds"), tag="loaded", pipeline_stages=stages)
    _, facts = _expected(CASES[0])
    script = Path(__file__).parent / "scripts" / "deepspeed_resume_pipeline.py"
    out = tmp_path / "losses.json"
    env = {
        **os.environ,
        "PYTHONPATH": f"{where}{os.pathsep}{FIXTURES}",
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
    }
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", str(script),
               str(tmp_path / "ds"), json.dumps(facts["config"]), str(stages), str(out)]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    losses = json.loads(out.read_text())
    for loss, want in zip(losses, facts["continued_losses"], strict=True):
        assert abs(loss - want) <= 1e-6 * abs(want), (losses, facts["continued_losses"])


def test_the_import_writes_the_whole_model_once(tmp_path):
    from zeroshard.checkpoint import convert_deepspeed_checkpoint, get_fp32_state_dict_from_zero_checkpoint

    tensors, _ = _expected("pp2_dp2_fp32")
    converted = convert_deepspeed_checkpoint(str(FIXTURES / "pp2_dp2_fp32" / "ckpt"), str(tmp_path / "zs"))
    weights = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "zs"), tag=Path(converted).name)
    assert set(weights) == {n.removeprefix("fp32.") for n in tensors if n.startswith("fp32.")}
    for name, value in weights.items():
        assert torch.equal(value, tensors[f"fp32.{name}"]), name


def _hostile_copy(tmp_path: Path, edit) -> str:
    copy = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "pp2_dp2_fp32" / "ckpt", copy)
    edit(copy / "global_step2")
    return str(copy)


def _other_runs_stage(step: Path) -> None:
    """Stage 1's optimizer partitions taken from the bf16 run of the same model (a copy of another checkpoint):
    its tied embedding is another run's."""
    other = FIXTURES / "pp2_dp2_bf16" / "ckpt" / "global_step2"
    for rank in (0, 1):
        shutil.copy(other / f"bf16_zero_pp_rank_{rank}_mp_rank_01_optim_states.pt",
                    step / f"zero_pp_rank_{rank}_mp_rank_01_optim_states.pt")  # fmt: skip


def _stage_count(value):
    """Stage 0's model states rewritten to claim ``value`` stages (read with the restricted reader, saved by torch)."""

    def edit(step: Path) -> None:
        from zeroshard.checkpoint.deepspeed_record import read_deepspeed_file

        model = read_deepspeed_file(str(step / "mp_rank_00_model_states.pt"))
        torch.save({**model, "mp_world_size": value}, step / "mp_rank_00_model_states.pt")

    return edit


def test_a_layer_file_whose_pickle_would_run_code_is_refused_and_nothing_runs(tmp_path):
    from zeroshard.checkpoint import CheckpointError
    from zeroshard.checkpoint.deepspeed_import import read_deepspeed_checkpoint

    marker = tmp_path / "ran"

    def plant(step: Path) -> None:
        torch.save({"weight": CodeRunningPickle(marker)}, step / "layer_05-model_states.pt")

    with pytest.raises(CheckpointError, match="layer_05-model_states.pt"):
        read_deepspeed_checkpoint(_hostile_copy(tmp_path, plant))
    assert not marker.exists()


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda step: (step / "layer_03-model_states.pt").unlink(), "layer_03-model_states.pt is missing"),
        (
            lambda step: shutil.copy(step / "layer_00-model_states.pt", step / "layer_05-model_states.pt"),
            "a layer file of another model",
        ),
        (lambda step: (step / "zero_pp_rank_1_mp_rank_01_optim_states.pt").unlink(), "rank 1's optimizer states"),
        (lambda step: (step / "mp_rank_01_model_states.pt").unlink(), "a stage's files are missing"),
        (_other_runs_stage, "the tied parameter tied_modules.embed.weight differs"),
        (_stage_count("3"), "mp_world_size '3'.*a stage's files are missing"),
    ],
    ids=["missing_layer", "foreign_layer", "missing_partition", "missing_stage", "another_runs_stage", "stage_count"],
)
def test_a_broken_pipeline_checkpoint_is_a_named_error(tmp_path, edit, message):
    from zeroshard.checkpoint import CheckpointError
    from zeroshard.checkpoint.deepspeed_import import read_deepspeed_checkpoint

    with pytest.raises(CheckpointError, match=message):
        read_deepspeed_checkpoint(_hostile_copy(tmp_path, edit))
