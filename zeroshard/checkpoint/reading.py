"""Reading a checkpoint directory: which tag, a validated manifest, and verified reads of saved tensors.

Shared by ``load_checkpoint``, consolidation (``zeroshard convert``) and ``init_inference``, so each of them
trusts exactly the same things: see ``manifest.validate`` and the checkpoint guarantees (docs/tutorials/checkpoints.md).
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

import torch

from .manifest import Piece, overlapping, piece_dtype, plain_name, saved_split, validate
from .safetensors_io import DTYPES, CheckpointError, Reader


def _torch_name(safetensors_dtype: str) -> str:
    return str(DTYPES[safetensors_dtype]).removeprefix("torch.")


class Sources:
    """Readers of one checkpoint directory; each tensor is verified against its checksum once, on first use."""

    def __init__(self, path: str, manifest: dict):
        self.path, self.manifest = path, manifest
        self._readers: dict[str, Reader] = {}
        self._verified: set[tuple[str, str]] = set()

    def reader(self, file: str) -> Reader:
        if file not in self._readers:
            expected = self.manifest["files"].get(file)
            if expected is None:
                raise CheckpointError(f"{self.path}: manifest lists no file {file}")
            location = os.path.join(self.path, plain_name(file, "file", self.path))
            if os.path.dirname(os.path.realpath(location)) != os.path.realpath(self.path):
                raise CheckpointError(
                    f"checkpoint file {location} links to {os.path.realpath(location)}, outside the checkpoint "
                    "directory (a checkpoint's files must be its own)"
                )
            reader = Reader(location, expected["header_crc"])
            if reader.size != expected["size"]:
                raise CheckpointError(
                    f"checkpoint file {reader.path} has {reader.size} bytes, the manifest "
                    f"says {expected['size']} (truncated or replaced)"
                )
            self._readers[file] = reader
        return self._readers[file]

    def read(self, file: str, key: str, dtype: str, start: int = 0, stop: Optional[int] = None) -> torch.Tensor:
        """Elements [start, stop) of a saved tensor of the manifest's ``dtype``, after verifying the whole tensor
        once (streamed). The file's header must store that dtype: reinterpreted bytes (F32 relabelled I32 with the
        checksums redone) would load as other numbers."""
        reader = self.reader(file)
        stored = _torch_name(reader.entry(key)["dtype"])
        if stored != dtype:
            raise CheckpointError(
                f"checkpoint file {reader.path}: tensor '{key}' is stored as {stored}, the manifest says {dtype}"
            )
        if (file, key) not in self._verified:
            crc = self.manifest["files"][file]["crc"].get(key)
            if crc is None:
                raise CheckpointError(f"{self.path}: manifest has no checksum for '{key}' in {file}")
            reader.verify(key, crc)
            self._verified.add((file, key))
        return reader.read(key, start, stop)

    def read_whole(self, name: str, entry: dict) -> torch.Tensor:
        """A tensor saved whole (a buffer, a frozen parameter below stage 3, a client_state tensor), checked against
        its manifest ``entry``: the stored shape must be the manifest's."""
        reader = self.reader(entry["file"])
        header = reader.entry(entry["key"])
        if header["shape"] != list(entry["shape"]):
            raise CheckpointError(
                f"checkpoint file {reader.path}: '{name}' is stored with shape {header['shape']}, "
                f"the manifest says {list(entry['shape'])}"
            )
        dtype = entry["dtype"]
        if dtype == "float32" and DTYPES[header["dtype"]].is_floating_point:
            dtype = _torch_name(header["dtype"])  # manifests before stored dtypes said float32 for every float
        return self.read(entry["file"], entry["key"], dtype).view(entry["shape"])

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()


class MemorySources:
    """A checkpoint built in memory (a DeepSpeed universal folder read for ``load_checkpoint``): the reads of
    :class:`Sources`, served from ``tensors`` (key -> tensor) that were checked when they were read."""

    def __init__(self, path: str, manifest: dict, tensors: dict[str, torch.Tensor]):
        self.path, self.manifest, self._tensors = path, manifest, tensors

    def read(self, file: str, key: str, dtype: str, start: int = 0, stop: Optional[int] = None) -> torch.Tensor:
        return self._tensors[key].reshape(-1)[start:stop].to(getattr(torch, dtype))

    def read_whole(self, name: str, entry: dict) -> torch.Tensor:
        return self._tensors[entry["key"]].view(entry["shape"])

    def close(self) -> None:
        self._tensors = {}


def scalar_value(entry: dict, device: Any = None) -> Any:
    """A saved scalar record (``save._scalar``: an optimizer's ``step``, ...) as the value it stands for."""
    if entry["tensor"]:
        return torch.tensor(entry["value"], dtype=getattr(torch, entry["dtype"]), device=device)
    return entry["value"]


def resolve_tag(load_dir: str, tag: Optional[str], pointer: str = "latest") -> Optional[str]:
    """The tag to load: ``tag``, else the one the file ``pointer`` names (``latest``, or DeepSpeed's
    ``latest_universal``): a plain name inside ``load_dir``. None without either."""
    if tag is not None:
        return plain_name(tag, "checkpoint tag", load_dir)
    latest = os.path.join(load_dir, pointer)
    if not os.path.isfile(latest):
        return None
    try:
        with open(latest) as f:
            tag = plain_name(f.read().strip(), f"tag in '{pointer}'", latest)
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{latest}: cannot read it ({err})") from None
    if tag.startswith(".") and tag.endswith(".tmp") and not os.path.isdir(os.path.join(load_dir, tag)):
        return tag[1:-4]  # a re-save of this tag ended between its rename and rewriting 'latest' (see _commit)
    return tag


def load_json(path: str) -> Any:
    """The JSON in ``path`` (a file a checkpoint holds, so anyone may have written it): any way it cannot be read is
    a ``CheckpointError`` naming the file (nested too deeply, an integer of more digits than Python converts, not
    UTF-8, not JSON)."""
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except RecursionError:
        raise CheckpointError(f"{path} is corrupted: it nests too deeply to be what a checkpoint writes") from None
    except (ValueError, UnicodeDecodeError) as err:  # JSONDecodeError, and Python's limit on an integer's digits
        raise CheckpointError(f"{path} is corrupted: {err}") from None


def read_manifest(path: str) -> dict:
    manifest_path = os.path.join(path, "manifest.json")
    if not os.path.isfile(manifest_path):
        raise CheckpointError(f"{path} is not a complete checkpoint: manifest.json is missing")
    body = validate(load_json(manifest_path), manifest_path)
    directory = os.path.basename(os.path.normpath(path))
    if directory not in (body["tag"], f".{body['tag']}.tmp"):  # .tmp: a re-save between two renames (_commit)
        raise CheckpointError(
            f"{manifest_path}: the checkpoint in directory '{directory}' was saved as tag '{body['tag']}' (a copy of, "
            "or link to, another checkpoint); load it under its own tag"
        )
    return body


def assemble(
    sources: Sources, pieces: list[Piece], prefix: str, dtype: str, start: int, stop: int, out: torch.Tensor
) -> None:
    """Fill ``out`` with elements [start, stop) of a flattened parameter from the saved pieces (stored as
    ``dtype``: see ``manifest.piece_dtype``)."""
    covered = 0
    for piece, (s0, s1), (d0, d1) in overlapping(pieces, start, stop):
        out[d0:d1].copy_(sources.read(piece.file, f"{prefix}.{piece.key}", dtype, s0, s1))
        covered += d1 - d0
    if covered != stop - start:
        raise CheckpointError(f"{sources.path}: saved pieces cover {covered} of {stop - start} elements")


def read_parameter(sources: Sources, name: str, prefix: str = "master") -> torch.Tensor:
    """The whole saved parameter ``name`` (its ``prefix`` state: ``master``, ``optim.exp_avg``, ...) in the shape the
    model defines it: a tensor-parallel one is joined from every rank's piece (see ``manifest.ParamEntry``)."""
    entry = sources.manifest["params"][name]
    shape = tuple(entry["shape"])
    pieces = [Piece.from_json(p) for p in entry["pieces"]]
    dtype = piece_dtype(sources.manifest, name, pieces[0].key)
    out = torch.empty(torch.Size(shape).numel(), dtype=getattr(torch, dtype))
    assemble(sources, pieces, prefix, dtype, 0, out.numel(), out)
    split = saved_split(entry)
    if split is None:
        return out.view(shape)
    return split.join(list(out.view(split.parts, *split.piece_shape(shape))))
