"""The atomic commit of a checkpoint: a save is written into ``.<tag>.tmp`` with every file fsynced, then renamed to
``<tag>``, and only then does ``latest`` name it, so at every moment ``latest`` names a complete checkpoint."""

from __future__ import annotations

import os
import shutil
import warnings
from typing import Optional


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def commit(save_dir: str, tag: str, save_latest: bool, keep_replaced: bool) -> None:
    """Move the complete ``.<tag>.tmp`` into place as ``<tag>`` and point ``latest`` at it.

    Re-saving an existing tag cannot swap two directories atomically, so ``latest`` first moves to the new
    complete copy (``.<tag>.tmp``) when it named the old one; the old directory is moved away, the new one
    renamed, and ``latest`` set to ``<tag>``. A crash between the rename and the last write leaves ``latest``
    naming ``.<tag>.tmp``, which ``resolve_tag`` reads as ``<tag>``. Every step is fsynced, so at every moment
    ``latest`` names a complete checkpoint. With ``keep_replaced`` the old directory is kept under a free name."""
    tmp, final = os.path.join(save_dir, f".{tag}.tmp"), os.path.join(save_dir, tag)
    latest = os.path.join(save_dir, "latest")
    replacing = os.path.exists(final)
    if replacing and read_latest(save_dir) == tag:
        atomic_write_text(latest, f".{tag}.tmp")
    trash = os.path.join(save_dir, f".{tag}.old")
    if replacing and keep_replaced:
        aside = _free_name(os.path.join(save_dir, f"{tag}.replaced"))
        warnings.warn(
            f"save_checkpoint: {final} was not written by this run; it is kept as {aside}, not overwritten",
            stacklevel=4,
        )
        os.replace(final, aside)
    elif replacing:
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(final, trash)
    os.replace(tmp, final)
    fsync_dir(save_dir)
    if save_latest or read_latest(save_dir) == f".{tag}.tmp":
        atomic_write_text(latest, tag)
    shutil.rmtree(trash, ignore_errors=True)


def _free_name(path: str) -> str:
    """``path``, or ``path.N`` with the smallest N that names nothing yet."""
    candidate, n = path, 1
    while os.path.lexists(candidate):
        candidate, n = f"{path}.{n}", n + 1
    return candidate


def read_latest(save_dir: str) -> Optional[str]:
    try:
        with open(os.path.join(save_dir, "latest")) as f:
            return f.read().strip()
    except OSError:
        return None
