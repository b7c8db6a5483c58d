"""Reading a checkpoint directory: which tag, a validated manifest, and verified reads of saved tensors.

Shared by ``load_checkpoint``, consolidation (``zeroshard convert``) and ``init_inference``, so each of them
trusts exactly the same things: see ``manifest.validate`` and the README's checkpoint guarantees.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import torch

from .manifest import Piece, overlapping, plain_name, validate
from .safetensors_io import CheckpointError, Reader


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
            reader = Reader(os.path.join(self.path, plain_name(file, "file", self.path)), expected["header_crc"])
            if reader.size != expected["size"]:
                raise CheckpointError(
                    f"checkpoint file {reader.path} has {reader.size} bytes, the manifest "
                    f"says {expected['size']} (truncated or replaced)"
                )
            self._readers[file] = reader
        return self._readers[file]

    def read(self, file: str, key: str, start: int = 0, stop: Optional[int] = None) -> torch.Tensor:
        """Elements [start, stop) of a saved tensor, after verifying the whole tensor once (streamed)."""
        reader = self.reader(file)
        if (file, key) not in self._verified:
            crc = self.manifest["files"][file]["crc"].get(key)
            if crc is None:
                raise CheckpointError(f"{self.path}: manifest has no checksum for '{key}' in {file}")
            reader.verify(key, crc)
            self._verified.add((file, key))
        return reader.read(key, start, stop)

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()


def resolve_tag(load_dir: str, tag: Optional[str]) -> Optional[str]:
    """The tag to load: ``tag``, else the one ``latest`` names (a plain name inside ``load_dir``)."""
    if tag is not None:
        return plain_name(tag, "checkpoint tag", load_dir)
    latest = os.path.join(load_dir, "latest")
    if not os.path.isfile(latest):
        return None
    with open(latest) as f:
        tag = plain_name(f.read().strip(), "tag in 'latest'", latest)
    if tag.startswith(".") and tag.endswith(".tmp") and not os.path.isdir(os.path.join(load_dir, tag)):
        return tag[1:-4]  # a re-save of this tag ended between its rename and rewriting 'latest' (see _commit)
    return tag


def read_manifest(path: str) -> dict:
    manifest_path = os.path.join(path, "manifest.json")
    if not os.path.isfile(manifest_path):
        raise CheckpointError(f"{path} is not a complete checkpoint: manifest.json is missing")
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{manifest_path} is corrupted: {err}") from None
    return validate(manifest, manifest_path)


def assemble(sources: Sources, pieces: list[Piece], prefix: str, start: int, stop: int, out: torch.Tensor) -> None:
    """Fill ``out`` with elements [start, stop) of a flattened parameter from the saved pieces."""
    covered = 0
    for piece, (s0, s1), (d0, d1) in overlapping(pieces, start, stop):
        out[d0:d1].copy_(sources.read(piece.file, f"{prefix}.{piece.key}", s0, s1))
        covered += d1 - d0
    if covered != stop - start:
        raise CheckpointError(f"{sources.path}: saved pieces cover {covered} of {stop - start} elements")
