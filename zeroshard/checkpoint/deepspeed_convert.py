"""``zeroshard convert --from-deepspeed``: a DeepSpeed checkpoint (ZeRO rank files or a universal folder) written
as a zeroshard checkpoint, committed like a save (a failure leaves nothing behind; an existing tag is never
replaced)."""

from __future__ import annotations

import json
import os
import shutil
from typing import Optional

from .commit import atomic_write_text, commit
from .deepspeed_import import latest_tag, read_deepspeed_checkpoint
from .deepspeed_record import DeepSpeedCheckpoint, imported_manifest, imported_tensors, plain_client_state
from .deepspeed_universal import LATEST_UNIVERSAL, is_universal_checkpoint, read_universal_checkpoint
from .manifest import plain_name, rank_file, seal
from .reading import resolve_tag
from .safetensors_io import CheckpointError, write


def convert_deepspeed_checkpoint(ds_dir: str, out_dir: str, tag: Optional[str] = None) -> str:
    """``zeroshard convert --from-deepspeed``: write DeepSpeed's checkpoint ``ds_dir`` (tag ``tag`` or its
    ``latest``; a universal folder, or ``latest_universal`` where there is no ``latest``) as a zeroshard checkpoint
    under ``out_dir`` (same tag; ``latest`` set). Returns its directory."""
    named = tag if tag is not None else latest_tag(ds_dir)
    if named is None and resolve_tag(ds_dir, None, LATEST_UNIVERSAL) is not None:
        source = read_universal_checkpoint(ds_dir)
    elif named is not None and is_universal_checkpoint(os.path.join(ds_dir, plain_name(named, "tag", ds_dir))):
        source = read_universal_checkpoint(ds_dir, named)
    else:
        source = read_deepspeed_checkpoint(ds_dir, tag)
    tag = os.path.basename(source.path)
    final, tmp = os.path.join(out_dir, tag), os.path.join(out_dir, f".{tag}.tmp")
    if os.path.exists(final):
        raise CheckpointError(f"{final} exists; convert into another directory (nothing was replaced)")
    client, client_tensors = plain_client_state(source.client_state)
    os.makedirs(out_dir, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        _write(source, tmp, tag, client, client_tensors)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    commit(out_dir, tag, save_latest=True, keep_replaced=False)
    return final


def _write(source: DeepSpeedCheckpoint, tmp: str, tag: str, client: dict, client_tensors: dict) -> None:
    tensors, params = imported_tensors(source, client_tensors)
    file = rank_file(0)
    written = write(os.path.join(tmp, file), iter(tensors), [(n, t.dtype, tuple(t.shape)) for n, t in tensors])
    files = {file: {"size": os.path.getsize(os.path.join(tmp, file)), "header_crc": written.header_crc,
                    "crc": written.crcs}}  # fmt: skip
    manifest = imported_manifest(source, tag, client, client_tensors, params, files)
    atomic_write_text(os.path.join(tmp, "manifest.json"), json.dumps(seal(manifest)))


__all__ = ["convert_deepspeed_checkpoint"]
