"""The safetensors reader refuses headers whose entries do not tile the data exactly, names deep nesting, and reads
what the ``safetensors`` package writes."""

import json
import struct

import pytest
import torch

from zeroshard.checkpoint.safetensors_io import CheckpointError, Reader, write


def _file(tmp_path, header: dict, data: bytes, name="t.safetensors"):
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path = tmp_path / name
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    return str(path)


def _entry(begin: int, end: int) -> dict:
    return {"dtype": "F32", "shape": [(end - begin) // 4], "data_offsets": [begin, end]}


def test_two_entries_on_the_same_bytes_are_refused(tmp_path):
    path = _file(tmp_path, {"a": _entry(0, 16), "b": _entry(0, 16)}, bytes(32))
    with pytest.raises(CheckpointError, match=r"tensors 'a' and 'b' share bytes \[0, 16\)"):
        Reader(path)
    path = _file(tmp_path, {"a": _entry(0, 16), "b": _entry(8, 24)}, bytes(24))
    with pytest.raises(CheckpointError, match=r"tensors 'a' and 'b' share bytes \[8, 16\)"):
        Reader(path)


def test_gaps_and_trailing_bytes_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match=r"data bytes \[16, 24\) belong to no tensor"):
        Reader(_file(tmp_path, {"a": _entry(0, 16), "b": _entry(24, 40)}, bytes(40)))
    with pytest.raises(CheckpointError, match="8 bytes after the last tensor"):
        Reader(_file(tmp_path, {"a": _entry(0, 16)}, bytes(24)))
    with pytest.raises(CheckpointError, match="is truncated: 8 data bytes, the header describes 16"):
        Reader(_file(tmp_path, {"a": _entry(0, 16)}, bytes(8)))


def test_a_deeply_nested_header_is_a_named_error(tmp_path):
    path = tmp_path / "deep.safetensors"
    blob = b"[" * 100_000 + b"]" * 100_000
    path.write_bytes(struct.pack("<Q", len(blob)) + blob)
    with pytest.raises(CheckpointError, match="nests too deeply"):
        Reader(str(path))


def test_files_of_the_safetensors_package_and_our_writer_read_back(tmp_path):
    from safetensors.torch import save_file

    tensors = {"w": torch.randn(3, 4), "b": torch.arange(5, dtype=torch.int64), "empty": torch.zeros(0)}
    save_file(tensors, tmp_path / "hf.safetensors")
    write(
        str(tmp_path / "ours.safetensors"), tensors.items(), [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]
    )
    for name in ("hf.safetensors", "ours.safetensors"):
        with Reader(str(tmp_path / name)) as reader:
            assert all(torch.equal(reader.read_tensor(k), v) for k, v in tensors.items())
