"""Universal folders edited as a careless or hostile user would: each is a ``CheckpointError`` naming the file, no
code in a pickle runs, nothing is written, and a folder that points outside the checkpoint is refused.

The edits start from the folder DeepSpeed 0.19.8's ``ds_to_universal`` wrote (``tests/fixtures/deepspeed_checkpoints/
fused_adamw_stage2_fp32/ckpt/global_step2_universal``), its DeepSpeed records re-saved as plain values, so no test
unpickles anything unrestricted.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from zeroshard.checkpoint import convert_deepspeed_checkpoint, export_universal_checkpoint, read_deepspeed_file
from zeroshard.checkpoint.safetensors_io import CheckpointError
from zeroshard.testing.hostile import CodeRunningPickle

from .test_deepspeed_import_hostile import _plain  # DeepSpeed's records as plain values

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "deepspeed_checkpoints"
TAG = "global_step2_universal"


def _folder(tmp_path: Path, case: str = "fused_adamw_stage2_fp32") -> Path:
    ds = tmp_path / "ds"
    shutil.copytree(FIXTURES / case / "ckpt" / TAG, ds / TAG)
    (ds / "latest_universal").write_text(TAG)
    for file in (ds / TAG).rglob("*.pt"):
        torch.save(_plain(read_deepspeed_file(str(file))), file)
    return ds


def _convert(ds: Path, tmp_path: Path) -> str:
    return convert_deepspeed_checkpoint(str(ds), str(tmp_path / "out"))


def _edit(file: Path, change) -> None:
    data = read_deepspeed_file(str(file))
    data = change(data) or data
    torch.save(data, file)


def _memo_graph():
    node: list = []
    for _ in range(60):
        node = [node, node]
    return node


def test_the_plain_copy_converts_and_resumes_the_same_values(tmp_path):
    from zeroshard.checkpoint.reading import Sources, read_manifest, read_parameter

    ds = _folder(tmp_path)
    out = _convert(ds, tmp_path)
    assert out.endswith(TAG)
    manifest = read_manifest(out)
    assert manifest["optimizer"]["type"] == "AdamW" and manifest["counters"]["global_steps"] == 2
    want = read_deepspeed_file(str(ds / TAG / "zero" / "up.weight" / "exp_avg_sq.pt"))["param"]
    assert torch.equal(read_parameter(Sources(out, manifest), "up.weight", "optim.exp_avg_sq"), want)


def test_a_pickle_that_runs_code_is_refused_and_does_not_run(tmp_path):
    ds = _folder(tmp_path)
    marker = tmp_path / "ran"
    torch.save({"param": CodeRunningPickle(marker)}, ds / TAG / "zero" / "up.weight" / "fp32.pt")
    with pytest.raises(CheckpointError, match=r"up.weight/fp32.pt: refused to unpickle"):
        _convert(ds, tmp_path)
    assert not marker.exists() and not (tmp_path / "out" / TAG).exists()


EDITS = [  # (label, file under the tag folder, edit, what the message says)
    ("shape-of-another-model", "zero/up.weight/fp32.pt",
     lambda d: {**d, "param": torch.zeros(5, 6)}, "model states give the parameter shape [10, 6]"),
    ("nan-master", "zero/down.bias/fp32.pt", lambda d: {**d, "param": torch.full((3,), float("nan"))}, "NaN"),
    ("negative-second-moment", "zero/norm.weight/exp_avg_sq.pt",
     lambda d: {**d, "param": -torch.ones(10)}, "negative values"),
    ("integer-master", "zero/up.bias/fp32.pt", lambda d: {**d, "param": torch.ones(10, dtype=torch.int64)},
     "dense floating-point tensor"),
    ("vocab-padding-record", "zero/up.weight/fp32.pt", lambda d: {**d, "vocab_tensor": True}, "'vocab_tensor'"),
    ("step-negative", "zero/up.weight/step.pt", lambda d: -1, "a step count"),
    ("step-text", "zero/up.weight/step.pt", lambda d: "2", "a step count"),
    ("steps-disagree", "zero/down.bias/step.pt", lambda d: 7, "other parameters of group 0 say"),
    ("memo-bomb", "zero/optimizer_state.pt", lambda d: {**d, "bomb": _memo_graph()}, "expands"),
    ("groups-missing", "zero/optimizer_state.pt", lambda d: {k: v for k, v in d.items() if k != "param_groups"},
     "field 'param_groups'"),
    ("stage-9", "zero/optimizer_state.pt", lambda d: {**d, "zero_stage": 9}, "field 'zero_stage' is 9"),
    ("own-record-forged", "zero/optimizer_state.pt", lambda d: {**d, "zeroshard": {"type": "AdamW"}},
     "field 'zeroshard'"),
    ("frozen-nan", "mp_rank_00_model_states.pt",
     lambda d: d["module"].__setitem__("extra.weight", torch.full((2,), float("nan"))), "'module['extra.weight']'"),
    ("frozen-placeholder", "mp_rank_00_model_states.pt",
     lambda d: d["module"].__setitem__("extra.weight", torch.empty(0)), "neither zero/extra.weight/fp32.pt"),
    ("frozen-shapes-list", "mp_rank_00_model_states.pt", lambda d: d.__setitem__("frozen_param_shapes", ["x"]),
     "field 'frozen_param_shapes'"),
    ("parameter-outside", "mp_rank_00_model_states.pt",
     lambda d: d["param_shapes"][0].__setitem__("../../etc", torch.Size([3])), "not a plain name"),
]  # fmt: skip


@pytest.mark.parametrize("label,name,change,said", EDITS, ids=[e[0] for e in EDITS])
def test_an_edited_universal_folder_is_a_named_error_and_nothing_is_written(tmp_path, label, name, change, said):
    ds = _folder(tmp_path)
    _edit(ds / TAG / name, change)
    started = time.monotonic()
    with pytest.raises(CheckpointError) as caught:
        _convert(ds, tmp_path)
    assert said in str(caught.value) and TAG in str(caught.value), str(caught.value)
    assert not (tmp_path / "out" / TAG).exists()
    assert time.monotonic() - started < 120  # a bound, not a timing: an unbounded walk of 2**60 never returns


def test_missing_or_foreign_state_files_are_named(tmp_path):
    ds = _folder(tmp_path)
    (ds / TAG / "zero" / "up.weight" / "exp_avg.pt").unlink()
    with pytest.raises(CheckpointError, match=r"up.weight: the checkpoint ran Adam.*missing \['exp_avg'\]"):
        _convert(ds, tmp_path)
    ds = _folder(tmp_path / "again")
    shutil.copy(ds / TAG / "zero" / "down.bias" / "exp_avg.pt", ds / TAG / "zero" / "down.bias" / "momentum.pt")
    with pytest.raises(CheckpointError, match=r"down.bias: optimizer state \['exp_avg', 'exp_avg_sq', 'momentum'\]"):
        _convert(ds, tmp_path)
    ds = _folder(tmp_path / "third")
    shutil.rmtree(ds / TAG / "zero" / "norm.bias")
    with pytest.raises(CheckpointError, match=r"zero/norm.bias: missing"):
        _convert(ds, tmp_path)


def test_folders_and_files_that_link_outside_are_refused(tmp_path):
    ds = _folder(tmp_path)
    outside = tmp_path / "elsewhere"
    shutil.move(ds / TAG / "zero" / "up.bias", outside)
    os.symlink(outside, ds / TAG / "zero" / "up.bias")
    with pytest.raises(CheckpointError, match=r"zero/up.bias links to .*outside the checkpoint's zero/ folder"):
        _convert(ds, tmp_path)
    ds = _folder(tmp_path / "again")
    target = ds / TAG / "zero" / "up.weight" / "fp32.pt"
    shutil.move(target, tmp_path / "fp32.pt")
    os.symlink(tmp_path / "fp32.pt", target)
    with pytest.raises(CheckpointError, match=r"fp32.pt links outside its parameter folder"):
        _convert(ds, tmp_path)
    (ds / "latest_universal").write_text("../ds")
    with pytest.raises(CheckpointError, match=r"tag in 'latest_universal' '../ds' is not a plain name"):
        _convert(ds, tmp_path)


def test_tensor_parallel_universal_folders_are_refused_by_name(tmp_path):
    ds = _folder(tmp_path)
    shutil.copy(ds / TAG / "mp_rank_00_model_states.pt", ds / TAG / "mp_rank_01_model_states.pt")
    with pytest.raises(CheckpointError, match=r"a tensor-, pipeline- or expert-parallel universal checkpoint"):
        _convert(ds, tmp_path)


def test_an_export_never_replaces_a_folder(tmp_path):
    ds = _folder(tmp_path)
    native = Path(_convert(ds, tmp_path)).parent
    first = export_universal_checkpoint(str(native), str(tmp_path / "exported"))
    assert first.endswith(f"{TAG}_universal")
    with pytest.raises(CheckpointError, match="exists; export into another directory"):
        export_universal_checkpoint(str(native), str(tmp_path / "exported"))
    assert not [p for p in (tmp_path / "exported").iterdir() if p.name.startswith(".")]


def test_the_cli_both_ways_and_its_refusals(tmp_path):
    """``zeroshard convert --from-deepspeed`` on a universal tag, then ``--to deepspeed-universal`` back: the same
    fp32 masters; a wrong combination of flags and a missing checkpoint end with exit code 2 and a message."""
    from zeroshard.launcher.cli import main

    ds = _folder(tmp_path)
    assert main(["convert", "--from-deepspeed", str(ds), str(tmp_path / "zs"), "--tag", TAG]) == 0
    assert main(["convert", str(tmp_path / "zs"), str(tmp_path / "back"), "--to", "deepspeed-universal"]) == 0
    again = tmp_path / "back" / f"{TAG}_universal" / "zero" / "up.weight" / "fp32.pt"
    original = ds / TAG / "zero" / "up.weight" / "fp32.pt"
    assert torch.equal(read_deepspeed_file(str(again))["param"], read_deepspeed_file(str(original))["param"])
    assert (tmp_path / "back" / "latest_universal").read_text() == f"{TAG}_universal"
    with pytest.raises(SystemExit):
        main(["convert", "--from-deepspeed", str(ds), str(tmp_path / "x"), "--to", "deepspeed-universal"])
    assert main(["convert", str(tmp_path / "missing"), str(tmp_path / "y"), "--to", "deepspeed-universal"]) == 2


@pytest.mark.parametrize("case", ["fused_adamw_stage2_fp32", "fused_adamw_stage3_bf16"])
def test_ds_to_universal_as_open_instruct_runs_it(tmp_path, case):
    """``python -m deepspeed.checkpoint.ds_to_universal --input_folder <ckpt>/<tag> --output_folder
    <ckpt>/ds_universal_<tag> --inject_missing_state`` in compat mode (open-instruct's call, as written) on DeepSpeed's
    ZeRO rank files: every fp32 master and Adam moment equals what DeepSpeed's own ds_to_universal wrote for the same
    checkpoint, and latest_universal names the new folder."""
    import subprocess
    import sys

    ckpt = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / case / "ckpt" / "global_step2", ckpt / "global_step2")
    env = {**os.environ, "ZEROSHARD_AS_DEEPSPEED": "1"}
    command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", ckpt / "global_step2",
               "--output_folder", ckpt / "ds_universal_global_step2", "--inject_missing_state"]  # fmt: skip
    done = subprocess.run(list(map(str, command)), env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (ckpt / "latest_universal").read_text() == "ds_universal_global_step2"
    theirs = FIXTURES / case / "ckpt" / TAG / "zero"
    for folder in theirs.iterdir():
        if folder.is_dir():
            for key in ("fp32", "exp_avg", "exp_avg_sq"):
                want = read_deepspeed_file(str(folder / f"{key}.pt"))
                got = read_deepspeed_file(str(ckpt / "ds_universal_global_step2" / "zero" / folder.name / f"{key}.pt"))
                want = want["param"] if isinstance(want, dict) else want
                assert torch.equal(got["param"].reshape(-1), want.float().reshape(-1)), (folder.name, key)
    again = subprocess.run(list(map(str, command)), env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and "exists; export into another directory" in again.stderr


# -- issue 52: what the docs promise of universal folders --------------------------------------------------------------
def _exported(tmp_path: Path) -> Path:
    """A universal folder zeroshard wrote (its ``zeroshard`` record in optimizer_state.pt), from the DeepSpeed
    fixture imported once: ``<dir>/<TAG>_universal``."""
    native = Path(_convert(_folder(tmp_path), tmp_path)).parent
    return Path(export_universal_checkpoint(str(native), str(tmp_path / "exported")))


@pytest.mark.parametrize("removed", [("exp_avg", "exp_avg_sq"), ("exp_avg_sq",)], ids=["both", "second-moment"])
def test_a_zeroshard_folder_missing_its_adam_state_is_refused(tmp_path, removed):
    """Every parameter's exp_avg.pt / exp_avg_sq.pt deleted: refused by name (not fresh Adam state, nor a KeyError
    at the first step), as a DeepSpeed-written folder in the same state is."""
    folder = _exported(tmp_path)
    for key in removed:
        for file in (folder / "zero").glob(f"*/{key}.pt"):
            file.unlink()
    with pytest.raises(CheckpointError, match=r"the checkpoint's 'zeroshard' record lists \['exp_avg', 'exp_avg_sq'\]"):
        convert_deepspeed_checkpoint(str(folder.parent), str(tmp_path / "back"), tag=folder.name)
    record = folder / "zero" / "optimizer_state.pt"  # a folder written before the record listed its keys
    _edit(record, lambda d: d["zeroshard"].__delitem__("state_keys"))
    with pytest.raises(CheckpointError, match=r"the checkpoint ran Adam, whose state is exp_avg.pt and exp_avg_sq.pt"):
        convert_deepspeed_checkpoint(str(folder.parent), str(tmp_path / "back"), tag=folder.name)
    assert not (tmp_path / "back").exists()


def _with_frozen(folder: Path, module_value: torch.Tensor, file_value, as_buffer: bool = False) -> None:
    """A frozen parameter 'extra.weight' (2 values) in the model states' module, with ``file_value`` as its
    zero/extra.weight/fp32.pt (None: no file); listed in frozen_param_shapes, or (``as_buffer``) among the buffers as
    an export of a checkpoint saved below stage 3 lists it."""
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):

        def change(d):
            d["module"]["extra.weight"] = module_value
            if as_buffer:
                d["buffer_names"] = [*d["buffer_names"], "extra.weight"]
            else:
                d["frozen_param_shapes"] = {"extra.weight": torch.Size([2])}

        _edit(folder / name, change)
    if file_value is not None:
        (folder / "zero" / "extra.weight").mkdir()
        torch.save({"param": file_value, "cat_dim": 0}, folder / "zero" / "extra.weight" / "fp32.pt")


@pytest.mark.parametrize("as_buffer", [False, True], ids=["frozen_param_shapes", "buffer_names"])
def test_a_frozen_parameters_file_wins_over_the_module_and_both_must_be_finite(tmp_path, as_buffer):
    from zeroshard.checkpoint.reading import Sources, read_manifest

    folder = _exported(tmp_path)
    _with_frozen(folder, torch.tensor([1.0, 2.0]), torch.tensor([7.0, 8.0]), as_buffer)
    out = convert_deepspeed_checkpoint(str(folder.parent), str(tmp_path / "back"), tag=folder.name)
    manifest = read_manifest(out)
    got = Sources(out, manifest).read_whole("extra.weight", manifest["module_tensors"]["extra.weight"])
    assert torch.equal(got, torch.tensor([7.0, 8.0]))  # the file, as the reader's docstring says
    folder = _exported(tmp_path / "nan")
    _with_frozen(folder, torch.tensor([1.0, float("nan")]), torch.tensor([7.0, 8.0]), as_buffer)
    with pytest.raises(CheckpointError, match=r"field 'module\['extra.weight'\]' .*holds NaN"):
        convert_deepspeed_checkpoint(str(folder.parent), str(tmp_path / "nan" / "back"), tag=folder.name)


def test_a_buffer_holding_nan_is_refused(tmp_path):
    folder = _exported(tmp_path)
    _with_frozen(folder, torch.tensor([float("nan"), 1.0]), None, as_buffer=True)
    with pytest.raises(CheckpointError, match=r"field 'module\['extra.weight'\]' \(a buffer\) holds NaN"):
        convert_deepspeed_checkpoint(str(folder.parent), str(tmp_path / "back"), tag=folder.name)
    assert not (tmp_path / "back").exists()


def test_a_universal_folder_without_its_optimizer_state_is_named_everywhere(tmp_path):
    """Not taken for DeepSpeed's rank files (whose import then failed on it): load, convert --from-deepspeed and
    the universal reader all name the missing file."""
    from zeroshard.checkpoint.deepspeed_universal import is_universal_checkpoint, read_universal_checkpoint

    ds = _folder(tmp_path)
    (ds / TAG / "zero" / "optimizer_state.pt").unlink()
    said = "a DeepSpeed universal checkpoint without zero/optimizer_state.pt"
    with pytest.raises(CheckpointError, match=said):
        is_universal_checkpoint(str(ds / TAG))
    with pytest.raises(CheckpointError, match=said):
        _convert(ds, tmp_path)
    with pytest.raises(CheckpointError, match=said):
        read_universal_checkpoint(str(ds), TAG)
    assert not (tmp_path / "out").exists()


def test_ds_to_universal_refuses_a_universal_input_and_an_unwritable_output(tmp_path):
    from zeroshard.checkpoint.universal_export import write_universal_folder

    ds = _folder(tmp_path)
    with pytest.raises(CheckpointError, match=r"is already a universal checkpoint: resume it with"):
        write_universal_folder(str(ds / TAG), str(tmp_path / "again" / "out"))
    native = Path(_convert(ds, tmp_path))
    with pytest.raises(CheckpointError, match=r"cannot write the universal folder /proc/zeroshard-test/out"):
        write_universal_folder(str(native), "/proc/zeroshard-test/out")
    with pytest.raises(CheckpointError, match=r"cannot write the universal folder"):
        write_universal_folder(str(native), "/proc/out")
