"""A manifest's tensor-parallel records are checked like everything else in it: an edited split (another degree, a
shape it cannot cut, a malformed record) is a named CheckpointError before anything is read."""

import pytest

from zeroshard.checkpoint.manifest import FORMAT, seal, validate
from zeroshard.checkpoint.safetensors_io import CheckpointError


def manifest(split, shape=(4, 2), tensor_parallel_size=2) -> dict:
    numel = shape[0] * shape[1]
    half = numel // 2
    pieces = [["rank00000.safetensors", "fg0", 0, 0, half], ["rank00001.safetensors", "fg0", 0, half, numel - half]]
    files = {f"rank0000{r}.safetensors": {"size": 0, "header_crc": 0, "crc": {}} for r in (0, 1)}
    body = {
        "format": FORMAT,
        "tag": "t",
        "world_size": 2,
        "tensor_parallel_size": tensor_parallel_size,
        "stage": 0,
        "shard_group_size": 1,
        "counters": {"global_steps": 0, "global_samples": 0, "skipped_steps": 0, "micro_steps": 0},
        "loss_scaler": None,
        "lr_scheduler": None,
        "optimizer": {"param_groups": [], "flat_groups": []},
        "params": {"w": {"pieces": pieces, "shape": list(shape), "dtype": "float32", "split": split}},
        "module_tensors": {},
        "files": files,
        "python_rng": {},
        "aliases": {},
        "config": {},
        "client_state": {},
    }
    return seal(body)


SPLIT = {"dim": 0, "parts": 2, "fused": 1, "transposed": False}


def test_a_split_parameter_validates():
    assert validate(manifest(SPLIT), "m")["params"]["w"]["split"] == SPLIT


@pytest.mark.parametrize(
    "split,shape,size,message",
    [
        ({**SPLIT, "parts": 4}, (4, 2), 2, "cuts over 4 ranks, the checkpoint was saved by 2"),
        (SPLIT, (3, 2), 2, "dim 0 of size 3 is not divisible by 2 ranks"),
        ({**SPLIT, "dim": 2}, (4, 2), 2, "has no dim 2"),
        ({**SPLIT, "parts": True}, (4, 2), 2, "holds integers and a boolean"),
        ({"dim": 0}, (4, 2), 2, "needs dim, parts, fused and transposed"),
    ],
)
def test_an_edited_split_is_named(split, shape, size, message):
    with pytest.raises(CheckpointError, match=f"field 'params.w.split': .*{message}|{message}"):
        validate(manifest(split, shape, size), "m")


def test_an_unsealed_edit_fails_the_checksum():
    data = manifest(SPLIT)
    data["params"]["w"]["split"]["parts"] = 1
    with pytest.raises(CheckpointError, match="fails its checksum"):
        validate(data, "m")


def test_a_pipeline_records_layer_files_are_layer_indices_with_a_tie_key():
    from pydantic import ValidationError

    from zeroshard.checkpoint.manifest import PipelineRecord

    record = PipelineRecord(stages=2, parts=[0, 3, 7], layer_files=[[0, "embed"], [1, ""], [6, ""]])
    assert record.layer_files == [[0, "embed"], [1, ""], [6, ""]]
    assert PipelineRecord(stages=2, parts=[0, 3, 7]).layer_files is None  # saved before it was kept
    for bad in ([[7, ""]], [[-1, ""]], [[True, ""]], [[1]], [[1, 2]], [["1", ""]], [[1, "", 3]]):
        with pytest.raises(ValidationError, match="layer_files entry"):
            PipelineRecord(stages=2, parts=[0, 3, 7], layer_files=bad)
