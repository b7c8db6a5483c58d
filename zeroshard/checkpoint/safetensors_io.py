"""Streaming reader and writer of the safetensors format (no pickle, no whole-file buffering).

Layout: 8-byte little-endian header length, a JSON header mapping each name to dtype, shape and
byte offsets, then the raw little-endian bytes. Writing streams one tensor at a time; reading a
slice of a 1-D tensor reads only those bytes. Files are plain safetensors, readable by the
``safetensors`` package and Hugging Face ``from_pretrained``.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
import zlib
from dataclasses import dataclass
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


def _write_tensor(f, tensor: torch.Tensor) -> int:
    """Write a tensor's bytes; returns their crc32. The bytes are read through ctypes, not ``.numpy()``: numpy's
    view marks the storage non-resizable for good, and ``offload_states`` frees a storage by resizing it."""
    flat = tensor.detach().contiguous().view(-1).cpu()  # kept alive while its bytes are read
    nbytes = flat.numel() * flat.element_size()
    if nbytes == 0:
        return zlib.crc32(b"")
    raw = memoryview((ctypes.c_char * nbytes).from_address(flat.data_ptr())).cast("B")
    f.write(raw)
    return zlib.crc32(raw)


@dataclass(frozen=True)
class Written:
    header_crc: int  # crc32 of the JSON header: names, dtypes, shapes and offsets
    crcs: dict[str, int]  # crc32 of each tensor's bytes


def write(
    path: str,
    tensors: Iterable[tuple[str, torch.Tensor]],
    specs: list[tuple[str, torch.dtype, tuple]],
    metadata: Optional[dict[str, str]] = None,
) -> Written:
    """Write tensors (produced lazily, in ``specs`` order) to ``path`` and fsync; returns the checksums."""
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
            crcs[name] = _write_tensor(f, tensor)
        f.flush()
        os.fsync(f.fileno())
    return Written(zlib.crc32(blob), crcs)


def _check_entry(name: str, entry) -> None:
    """One header entry is well formed: a known dtype, a shape, and offsets spanning exactly its bytes."""
    if not isinstance(entry, dict) or entry.get("dtype") not in DTYPES:
        raise ValueError(f"tensor '{name}': unknown dtype {entry.get('dtype') if isinstance(entry, dict) else entry!r}")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ValueError(f"tensor '{name}': bad shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise ValueError(f"tensor '{name}': bad data_offsets {offsets!r}")
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=DTYPES[entry["dtype"]]).element_size()
    if offsets[1] - offsets[0] != nbytes:
        span = offsets[1] - offsets[0]
        raise ValueError(f"tensor '{name}': data_offsets span {span} bytes, dtype and shape give {nbytes}")


def _check_tiling(path: str, header: dict, data_bytes: int) -> None:
    """The tensors tile the data exactly, in some order (as the safetensors format requires): two entries on the
    same bytes would make one weight silently hold another's values, and bytes no entry describes are damage."""
    end, previous = 0, None
    for name, entry in sorted(header.items(), key=lambda item: tuple(item[1]["data_offsets"])):
        start, stop = entry["data_offsets"]
        if start < end:
            raise CheckpointError(
                f"checkpoint file {path}: tensors '{previous}' and '{name}' share bytes [{start}, {min(end, stop)}) "
                "of the data (one would read the other's values)"
            )
        if start > end:
            raise CheckpointError(f"checkpoint file {path}: data bytes [{end}, {start}) belong to no tensor")
        end, previous = stop, name
    if end > data_bytes:
        raise CheckpointError(
            f"checkpoint file {path} is truncated: {data_bytes} data bytes, the header describes {end}"
        )
    if end < data_bytes:
        raise CheckpointError(f"checkpoint file {path}: {data_bytes - end} bytes after the last tensor")


class Reader:
    """Random access to one safetensors file; every read names the file and tensor when it fails."""

    def __init__(self, path: str, header_crc: Optional[int] = None):
        """``header_crc``, when the caller knows it (a zeroshard manifest does), must match the header's crc32:
        the data checksums cannot catch an edited dtype or shape, the header checksum does."""
        self.path = path
        if not os.path.isfile(path):
            raise CheckpointError(f"checkpoint file {path} is missing")
        self.size = os.path.getsize(path)
        self._file = open(path, "rb")
        try:
            (length,) = struct.unpack("<Q", self._file.read(8))
            if length > self.size - 8:
                raise ValueError(f"header of {length} bytes in a {self.size}-byte file")
            blob = self._file.read(length)
            if header_crc is not None and zlib.crc32(blob) != header_crc:
                raise CheckpointError(
                    f"checkpoint file {path}: its header (names, dtypes, shapes, offsets) fails its checksum "
                    "(edited or damaged)"
                )
            self.header = json.loads(blob)
            if not isinstance(self.header, dict):
                raise ValueError("the header is not a JSON object")
            self.metadata = self.header.pop("__metadata__", {})
            for name, entry in self.header.items():
                _check_entry(name, entry)
            self.data_start = 8 + length
            _check_tiling(path, self.header, self.size - self.data_start)
        except CheckpointError:  # a ValueError too: caught first, it says what is wrong already
            self._file.close()
            raise
        except RecursionError:
            self._file.close()
            raise CheckpointError(
                f"checkpoint file {path}: its header nests too deeply to be a safetensors header"
            ) from None
        except (struct.error, ValueError, UnicodeDecodeError) as err:
            self._file.close()
            raise CheckpointError(f"checkpoint file {path} is truncated or corrupted: bad header ({err})") from None

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
        numel = torch.Size(entry["shape"]).numel()
        stop = numel if stop is None else stop
        if not 0 <= start <= stop <= numel:
            raise CheckpointError(
                f"checkpoint file {self.path}: elements [{start}, {stop}) of tensor '{name}' requested, it has {numel}"
            )
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
