"""``deepspeed.launcher.runner``: the ``deepspeed`` command as a function (ArcticTraining's CLI calls ``main`` with
DeepSpeed's launcher arguments and extends ``EXPORT_ENVS``)."""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from zeroshard.launcher.cli import main as _launch

DEEPSPEED_ENVIRONMENT_NAME = ".deepspeed_env"  # file of KEY=VALUE lines exported to every rank
# prefixes of the launching environment's variables exported to every node of a multi-node launch (zeroshard
# exports NCCL_, PYTHON, TORCH_, ... already; these are added, read when main runs, so a client may extend them)
EXPORT_ENVS = ["MLFLOW", "PYTHON", "MV2", "UCX"]


def main(args: Optional[Sequence[str]] = None) -> None:
    """``deepspeed [launcher args] script [script args]`` through zeroshard's launcher; a failed job exits with its
    code, as DeepSpeed's runner does."""
    code = _launch(list(sys.argv[1:] if args is None else args), export_prefixes=tuple(EXPORT_ENVS))
    if code:
        sys.exit(code)


__all__ = ["DEEPSPEED_ENVIRONMENT_NAME", "EXPORT_ENVS", "main"]
