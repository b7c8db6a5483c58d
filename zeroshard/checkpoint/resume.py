"""Where ``checkpoint.auto_resume`` resumes: the checkpoint ``latest`` names, else the newest complete one in the
save directory (by the step its manifest records), and every rank must see the same one.

Without the fallback, a missing ``latest`` (deleted, or lost with a crash of the filesystem that held it) made a
restarted job train from step 0 and write its first saves over the checkpoints already there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from .. import comm
from .agreement import gather_text
from .reading import read_manifest, resolve_tag
from .safetensors_io import CheckpointError


@dataclass(frozen=True)
class ResumePoint:
    tag: str
    why: str  # for the log line: how this checkpoint was chosen


def complete_checkpoints(save_dir: str) -> dict[str, int]:
    """The complete checkpoints in ``save_dir`` (a manifest that validates, under its own tag) and their steps.
    Temporary directories of a save in progress (``.<tag>.tmp``) and anything unreadable are not candidates."""
    steps = {}
    try:
        names = sorted(os.listdir(save_dir))
    except OSError:
        return steps
    for name in names:
        path = os.path.join(save_dir, name)
        if name.startswith(".") or not os.path.isfile(os.path.join(path, "manifest.json")):
            continue
        try:
            steps[name] = read_manifest(path)["counters"]["global_steps"]
        except (CheckpointError, OSError):
            continue
    return steps


def resume_point(save_dir: str) -> Optional[ResumePoint]:
    """The checkpoint ``latest`` names; without ``latest``, the complete checkpoint of the highest step."""
    found = complete_checkpoints(save_dir)
    newest = max(found, key=lambda tag: (found[tag], tag), default=None)
    tag = resolve_tag(save_dir, None)
    if tag is not None:
        why = "named by 'latest'"
        if newest is not None and tag in found and found[newest] > found[tag]:
            why += (
                f"; {newest} (step {found[newest]}) is newer and complete (a save interrupted before it updated "
                f"'latest', or 'latest' set back by hand): point 'latest' at {newest} to resume there"
            )
        return ResumePoint(tag, why)
    if newest is None:
        return None
    return ResumePoint(
        newest, f"'latest' is missing; {newest} is the newest complete checkpoint (step {found[newest]})"
    )


def agree_on_resume_point(save_dir: str, world: comm.Group) -> Optional[ResumePoint]:
    """Every rank's choice must be the same (one shared directory): a rank that sees another checkpoint, or none,
    is an error naming the ranks, never a silent split."""
    point = resume_point(save_dir)
    choices = gather_text(point.tag if point else "", world)
    if len(set(choices)) > 1:
        listing = ", ".join(f"rank {r}: {c or 'none'}" for r, c in enumerate(choices))
        raise CheckpointError(
            f"checkpoint.auto_resume: the ranks see different checkpoints in {save_dir} ({listing}); "
            "checkpoint.save_dir must be one directory every rank reads (a shared filesystem)"
        )
    return point
