"""``deepspeed.launcher.runner``: the ``deepspeed`` command as a function (ArcticTraining's CLI calls ``main`` with
DeepSpeed's launcher arguments and extends ``EXPORT_ENVS``)."""

from __future__ import annotations

import os
import sys
from typing import Optional, Sequence, Union

from zeroshard.launcher.cli import SUBCOMMANDS, launch_arguments
from zeroshard.launcher.cli import main as _launch
from zeroshard.launcher.hostfile import filter_resources, parse_hostfile
from zeroshard.log import logger

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


def fetch_hostfile(hostfile_path: Union[str, os.PathLike]) -> Optional[dict[str, int]]:
    """DeepSpeed's: the hostfile's ``{host: slot count}``, or None (with a warning) when there is no such file."""
    if not os.path.isfile(hostfile_path):
        logger.warning(f"hostfile {hostfile_path} not found: training on the local resources only")
        return None
    with open(hostfile_path) as f:
        return _parse_hostfile(f.read(MAX_HOSTFILE_BYTES + 1).splitlines())


MAX_HOSTFILE_BYTES = 1 << 20  # a million characters is a few thousand hosts; more is not a hostfile


def parse_inclusion_exclusion(resource_pool: dict[str, int], inclusion: str, exclusion: str) -> dict[str, list[int]]:
    """DeepSpeed's: ``--include`` / ``--exclude`` applied to what the hosts have (``{host: slot count}``)."""
    return parse_resource_filter(
        {host: list(range(slots)) for host, slots in resource_pool.items()}, inclusion, exclusion
    )


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


__all__ = [
    "DEEPSPEED_ENVIRONMENT_NAME",
    "EXPORT_ENVS",
    "fetch_hostfile",
    "main",
    "parse_inclusion_exclusion",
    "parse_resource_filter",
]
