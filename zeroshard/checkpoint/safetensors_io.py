"""Streaming reader and writer of the safetensors format (no pickle, no whole-file buffering).

Layout: 8-byte little-endian header length, a JSON header mapping each name to dtype, shape and
byte offsets, then the raw little-endian bytes. Writing streams one tensor at a time; reading a
slice of a 1-D tensor reads only those bytes. Files are plain safetensors, readable by the
``safetensors`` package and Hugging Face ``from_pretrained``.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from typing import Iterable, Optional

import torch

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
NAMES = {v: k for k, v in DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated, corrupted or does not match the model."""


def _raw(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().contiguous().view(-1).cpu()
    return memoryview(flat.view(torch.uint8).numpy())


def write(
    path: str,
    tensors: Iterable[tuple[str, torch.Tensor]],
    specs: list[tuple[str, torch.dtype, tuple]],
    metadata: Optional[dict[str, str]] = None,
) -> dict[str, int]:
    """Write tensors (produced lazily, in ``specs`` order) to ``path`` and fsync; returns crc32 per name."""
    header, offset = {}, 0
    for name, dtype, shape in specs:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = metadata
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # keep the data 8-byte aligned
    crcs = {}
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for (name, tensor), (spec_name, dtype, shape) in zip(tensors, specs):
            if name != spec_name or tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
                raise AssertionError(f"tensor {name} does not match its spec {spec_name} {dtype} {shape}")
            raw = _raw(tensor)
            crcs[name] = zlib.crc32(raw)
            f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    return crcs


class Reader:
    """Random access to one safetensors file; every read names the file and tensor when it fails."""

    def __init__(self, path: str):
        self.path = path
        if not os.path.isfile(path):
            raise CheckpointError(f"checkpoint file {path} is missing")
        self.size = os.path.getsize(path)
        self._file = open(path, "rb")
        try:
            (length,) = struct.unpack("<Q", self._file.read(8))
            if length > self.size - 8:
                raise ValueError(f"header of {length} bytes in a {self.size}-byte file")
            self.header = json.loads(self._file.read(length))
        except (struct.error, ValueError, UnicodeDecodeError) as err:
            self._file.close()
            raise CheckpointError(f"checkpoint file {path} is truncated or corrupted: bad header ({err})") from None
        self.data_start = 8 + length
        self.metadata = self.header.pop("__metadata__", {})
        end = max((v["data_offsets"][1] for v in self.header.values()), default=0)
        if self.data_start + end > self.size:
            self._file.close()
            raise CheckpointError(
                f"checkpoint file {path} is truncated: {self.size} bytes, header describes {self.data_start + end}"
            )

    def keys(self) -> list[str]:
        return list(self.header)

    def entry(self, name: str) -> dict:
        if name not in self.header:
            raise CheckpointError(f"checkpoint file {self.path} has no tensor '{name}'")
        return self.header[name]

    def read(self, name: str, start: int = 0, stop: Optional[int] = None) -> torch.Tensor:
        """Elements [start, stop) of the flattened tensor, reading only those bytes."""
        entry = self.entry(name)
        dtype = DTYPES[entry["dtype"]]
        elem = torch.empty((), dtype=dtype).element_size()
        stop = torch.Size(entry["shape"]).numel() if stop is None else stop
        data = self._read_bytes(entry["data_offsets"][0] + start * elem, (stop - start) * elem)
        return torch.frombuffer(bytearray(data), dtype=dtype) if data else torch.empty(0, dtype=dtype)

    def read_tensor(self, name: str) -> torch.Tensor:
        return self.read(name).view(self.entry(name)["shape"])

    def verify(self, name: str, crc: int, chunk_bytes: int = 16 << 20) -> None:
        """Check a tensor's crc32 reading it in fixed-size chunks (memory stays at one chunk)."""
        begin, end = self.entry(name)["data_offsets"]
        value, offset = 0, begin
        while offset < end:
            data = self._read_bytes(offset, min(chunk_bytes, end - offset))
            value = zlib.crc32(data, value)
            offset += len(data)
        if value != crc:
            raise CheckpointError(f"checkpoint file {self.path}: tensor '{name}' fails its checksum (corrupted)")

    def _read_bytes(self, offset: int, nbytes: int) -> bytes:
        self._file.seek(self.data_start + offset)
        data = self._file.read(nbytes)
        if len(data) != nbytes:
            raise CheckpointError(f"checkpoint file {self.path} is truncated")
        return data

    def close(self) -> None:
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
