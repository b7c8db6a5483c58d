"""``deepspeed.launcher.runner``: the ``deepspeed`` command as a function (ArcticTraining's CLI calls ``main`` with
DeepSpeed's launcher arguments and extends ``EXPORT_ENVS``)."""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from zeroshard.launcher.cli import SUBCOMMANDS, launch_arguments
from zeroshard.launcher.cli import main as _launch
from zeroshard.launcher.hostfile import filter_resources, parse_hostfile

DEEPSPEED_ENVIRONMENT_NAME = ".deepspeed_env"  # file of KEY=VALUE lines exported to every rank
# prefixes of the launching environment's variables exported to every node of a multi-node launch (zeroshard
# exports NCCL_, PYTHON, TORCH_, ... already; these are added, read when main runs, so a client may extend them)
EXPORT_ENVS = ["MLFLOW", "PYTHON", "MV2", "UCX"]


def _parse_hostfile(hostfile_lines: Sequence[str]) -> dict[str, int]:
    """DeepSpeed's hostfile reader: ``{host: slot count}`` in file order (``ValueError`` naming a bad line)."""
    return {host: len(slots) for host, slots in parse_hostfile("\n".join(hostfile_lines)).items()}


def parse_resource_filter(host_info: dict, include_str: str = "", exclude_str: str = "") -> dict[str, list[int]]:
    """DeepSpeed's ``--include`` / ``--exclude`` over ``{host: [slot, ...]}``."""
    return filter_resources(host_info, include_str or None, exclude_str or None)


def main(args: Optional[Sequence[str]] = None) -> None:
    """``deepspeed [launcher args] script [script args]`` through zeroshard's launcher; a failed job exits with its
    code, as DeepSpeed's runner does. Flags that cannot go together (``-i`` / ``-e`` with ``--num_nodes`` /
    ``--num_gpus``) raise DeepSpeed's ``ValueError`` before anything starts."""
    argv = list(sys.argv[1:] if args is None else args)
    if not argv or argv[0] not in SUBCOMMANDS:
        launch_arguments(argv)  # raises before anything starts
    code = _launch(argv, export_prefixes=tuple(EXPORT_ENVS))
    if code:
        sys.exit(code)


__all__ = ["DEEPSPEED_ENVIRONMENT_NAME", "EXPORT_ENVS", "main", "parse_resource_filter"]
