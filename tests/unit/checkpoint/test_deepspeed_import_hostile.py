"""DeepSpeed checkpoint files edited as a careless or hostile user would: each is a ``CheckpointError`` naming the
file and the field, nothing is written, and a pickle-memo graph (8 KB on disk, 2**60 nodes to a walk) is refused in
time linear in the file.

The edits start from the files DeepSpeed 0.19.8 wrote (``tests/fixtures/deepspeed_checkpoints``). They are read with
the restricted unpickler and saved again with DeepSpeed's classes replaced by plain values (the stage a plain int,
the loss scaler and the fragment records left out: the import needs neither), so no test unpickles anything
unrestricted.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import torch

from zeroshard.checkpoint.deepspeed_convert import convert_deepspeed_checkpoint
from zeroshard.checkpoint.deepspeed_record import read_deepspeed_file
from zeroshard.checkpoint.safetensors_io import CheckpointError

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "deepspeed_checkpoints"
MODEL = "mp_rank_00_model_states.pt"
OPTIM = "zero_pp_rank_{}_mp_rank_00_optim_states.pt"


def _plain(value):
    """DeepSpeed's records as plain values: ZeroStageEnum an int; the loss scaler and fragment addresses dropped."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if k not in ("loss_scaler", "param_slice_mappings")}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool):
        return int(value)
    return value


def _checkpoint(tmp_path: Path, case: str = "stage2_fp32") -> Path:
    ds = tmp_path / "ds"
    shutil.copytree(FIXTURES / case / "ckpt", ds)
    for file in (ds / "global_step2").iterdir():
        torch.save(_plain(read_deepspeed_file(str(file))), file)
    return ds


def _edit(ds: Path, name: str, change) -> None:
    file = ds / "global_step2" / name
    data = read_deepspeed_file(str(file))
    change(data)
    torch.save(data, file)


def _inner(data: dict) -> dict:
    return data["optimizer_state_dict"]


def _base(data: dict) -> dict:
    inner = _inner(data)
    return inner["base_optimizer_state"] if "base_optimizer_state" in inner else inner["optimizer_state_dict"]


def _set(path: list, value):
    def change(data):
        for key in path[:-1]:
            data = data[key]
        data[path[-1]] = value

    return change


def _drop_steps(data: dict) -> None:
    _base(data)["state"][0].pop("step", None)
    _base(data)["param_groups"][0].pop("step", None)


def _memo_graph():
    node: list = []
    for _ in range(60):
        node = [node, node]  # pickled once per level: 8 KB, 2**60 nodes walked
    return node


def _with_nan(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach().clone()
    tensor[3] = float("nan")
    return tensor


def _cycle():
    a: list = []
    a.append(a)
    return a


MASTERS = ["optimizer_state_dict", "single_partition_of_fp32_groups"]

# (label, file, edit, the message's field); every file name is checked in the message too
EDITS = [
    ("world-size-0", MODEL, _set(["dp_world_size"], 0), "field 'dp_world_size' is 0"),
    ("world-size-negative", MODEL, _set(["dp_world_size"], -2), "field 'dp_world_size' is -2"),
    ("world-size-missing", MODEL, lambda d: d.pop("dp_world_size"), "field 'dp_world_size' is missing"),
    ("world-size-float", MODEL, _set(["dp_world_size"], 2.0), "field 'dp_world_size' is 2.0"),
    ("shape-negative", MODEL, lambda d: d["param_shapes"][0].__setitem__("up.bias", torch.Size([-1])), "up.bias"),
    ("shape-zero-size", MODEL, lambda d: d["param_shapes"][0].__setitem__("up.bias", (0,)), "without elements"),
    ("shape-not-dict", MODEL, _set(["param_shapes"], ["up.weight"]), "field 'param_shapes[0]'"),
    (
        "buffer-not-tensor",
        MODEL,
        lambda d: (d["module"].__setitem__("b", "text"), d.__setitem__("buffer_names", ["b"])),
        "field 'module['b'] (a buffer)'",
    ),  # fmt: skip
    ("steps-1e30", MODEL, _set(["global_steps"], 1e30), "field 'global_steps' is 1e+30"),
    ("steps-negative", MODEL, _set(["global_steps"], -1), "field 'global_steps' is -1"),
    ("config-list", MODEL, _set(["ds_config"], ["stage", 2]), "field 'ds_config'"),
    ("scheduler-string", MODEL, _set(["lr_scheduler"], "WarmupLR"), "field 'lr_scheduler'"),
    ("shared-not-names", MODEL, _set(["shared_params"], {"a": 1}), "field 'shared_params'"),
    (
        "stage-layout-mismatch",
        OPTIM.format(1),
        _set(["optimizer_state_dict", "zero_stage"], 3),
        "no 'fp32_flat_groups'",
    ),
    ("stage-7", OPTIM.format(0), _set(["optimizer_state_dict", "zero_stage"], 7), "field 'zero_stage' is 7"),
    ("stages-differ", OPTIM.format(1), _set(["optimizer_state_dict", "zero_stage"], 1), "disagree on zero_stage"),
    (
        "master-sparse",
        OPTIM.format(0),
        lambda d: _inner(d)[MASTERS[1]].__setitem__(0, _inner(d)[MASTERS[1]][0].to_sparse()),
        "field 'single_partition_of_fp32_groups[0]'",
    ),  # fmt: skip
    (
        "master-meta",
        OPTIM.format(1),
        lambda d: _inner(d)[MASTERS[1]].__setitem__(0, torch.empty(31, device="meta")),
        "field 'single_partition_of_fp32_groups[0]'",
    ),  # fmt: skip
    (
        "master-list",
        OPTIM.format(0),
        lambda d: _inner(d)[MASTERS[1]].__setitem__(0, [0.0] * 31),
        "field 'single_partition_of_fp32_groups[0]' is",
    ),  # fmt: skip
    (
        "master-integer",
        OPTIM.format(0),
        lambda d: _inner(d)[MASTERS[1]].__setitem__(0, torch.arange(31)),
        "dense floating-point tensor",
    ),  # fmt: skip
    (
        "master-nan",
        OPTIM.format(1),
        lambda d: _inner(d)[MASTERS[1]].__setitem__(0, _with_nan(_inner(d)[MASTERS[1]][0])),
        "NaN or inf",
    ),  # fmt: skip
    ("masters-missing-group", OPTIM.format(1), _set(MASTERS, []), "0 master partition(s)"),
    (
        "exp-avg-sq-negative",
        OPTIM.format(1),
        lambda d: _base(d)["state"][0]["exp_avg_sq"].__setitem__(2, -1.0),
        "holds negative values",
    ),  # fmt: skip
    (
        "exp-avg-short",
        OPTIM.format(0),
        lambda d: _base(d)["state"][0].__setitem__("exp_avg", torch.zeros(3)),
        "at least 62 elements",
    ),  # fmt: skip
    ("exp-avg-missing", OPTIM.format(0), lambda d: _base(d)["state"][0].pop("exp_avg"), "no 'exp_avg' (not Adam?)"),
    ("state-not-dict", OPTIM.format(0), lambda d: _base(d).__setitem__("state", [1, 2]), "base_optimizer_state.state"),
    ("lr-differs", OPTIM.format(1), lambda d: _base(d)["param_groups"][0].__setitem__("lr", 0.5), "'lr' is 0.5"),
    (
        "step-not-whole",
        OPTIM.format(1),
        lambda d: _base(d)["state"][0].__setitem__("step", torch.tensor(1.5)),
        "a whole step count",
    ),  # fmt: skip
    (
        "partition-count-text",
        OPTIM.format(0),
        _set(["optimizer_state_dict", "partition_count"], ["two"]),
        "field 'partition_count'",
    ),  # fmt: skip
    (
        "paddings-negative",
        OPTIM.format(0),
        _set(["optimizer_state_dict", "param_alignment_paddings"], [[-4]]),
        "field 'param_alignment_paddings'",
    ),  # fmt: skip
    ("bomb-client-state", MODEL, _set(["bomb"], _memo_graph()), "expands to more than"),
    ("bomb-ds-config", MODEL, _set(["ds_config", "bomb"], _memo_graph()), "expands to more than"),
    ("bomb-scheduler", MODEL, _set(["lr_scheduler", "bomb"], _memo_graph()), "expands to more than"),
    (
        "bomb-param-group",
        OPTIM.format(1),
        lambda d: _base(d)["param_groups"][0].__setitem__("bomb", _memo_graph()),
        "expands to more than",
    ),  # fmt: skip
    ("bomb-shared-string", MODEL, _set(["bomb"], ["x" * (1 << 20)] * 200), "expands to more than"),
    ("cycle", MODEL, _set(["bomb"], _cycle()), "contains itself"),
]


@pytest.mark.parametrize("label,name,change,field", EDITS, ids=[e[0] for e in EDITS])
def test_an_edited_deepspeed_file_is_a_named_error_and_nothing_is_written(tmp_path, label, name, change, field):
    ds = _checkpoint(tmp_path)
    _edit(ds, name, change)
    started = time.monotonic()
    with pytest.raises(CheckpointError) as caught:
        convert_deepspeed_checkpoint(str(ds), str(tmp_path / "out"))
    message = str(caught.value)
    assert field in message, message
    assert "global_step2" in message, message  # the file (or its directory) is named
    assert not (tmp_path / "out" / "global_step2").exists()
    assert time.monotonic() - started < 120  # a bound, not a timing: an unbounded walk of 2**60 never returns


def test_the_plain_copy_itself_imports(tmp_path):
    """The edits' starting point is sound: without an edit it converts."""
    assert convert_deepspeed_checkpoint(str(_checkpoint(tmp_path)), str(tmp_path / "out")).endswith("global_step2")


def test_steps_missing_on_every_rank_are_named(tmp_path):
    ds = _checkpoint(tmp_path)
    for rank in (0, 1):
        _edit(ds, OPTIM.format(rank), _drop_steps)
    with pytest.raises(
        CheckpointError, match=r"zero_pp_rank_0_mp_rank_00_optim_states.pt: parameter group 0's .*no 'step'"
    ):
        convert_deepspeed_checkpoint(str(ds), str(tmp_path / "out"))


def test_stage3_layout_mismatch_and_a_rank_file_that_is_a_directory(tmp_path):
    ds = _checkpoint(tmp_path, "stage3_fp32")
    _edit(ds, OPTIM.format(1), _set(["optimizer_state_dict", "zero_stage"], 2))
    with pytest.raises(CheckpointError, match=r"zero_pp_rank_1_mp_rank_00_optim_states.pt: .*no 'single_partition"):
        convert_deepspeed_checkpoint(str(ds), str(tmp_path / "out"))
    rank1 = ds / "global_step2" / OPTIM.format(1)
    rank1.unlink()
    rank1.mkdir()
    with pytest.raises(CheckpointError, match=r"zero_pp_rank_1_mp_rank_00_optim_states.pt: cannot read it"):
        convert_deepspeed_checkpoint(str(ds), str(tmp_path / "out"))
    assert not (tmp_path / "out" / "global_step2").exists()


def test_a_rank_file_beyond_the_world_size_is_refused(tmp_path):
    ds = _checkpoint(tmp_path)
    shutil.copy(ds / "global_step2" / OPTIM.format(1), ds / "global_step2" / OPTIM.format(2))
    with pytest.raises(CheckpointError, match="3 ranks' optimizer files, but the model states say dp_world_size 2"):
        convert_deepspeed_checkpoint(str(ds), str(tmp_path / "out"))
