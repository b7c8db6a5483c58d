"""``python -m zeroshard.compat.run [-m] script [args]``: run a script with ``import deepspeed`` served by zeroshard.

The launcher's ``--as_deepspeed`` starts every rank through this module, so an unmodified DeepSpeed, Hugging
Face or Accelerate script runs on zeroshard without relying on the ``.pth`` start-up hook.
"""

from __future__ import annotations

import os
import runpy
import sys

from .alias import ENV_FLAG, install_as_deepspeed


def main(argv: list[str]) -> None:
    as_module = argv[:1] == ["-m"]
    if as_module:
        argv = argv[1:]
    if not argv:
        raise SystemExit("usage: python -m zeroshard.compat.run [-m] script.py [args...]")
    os.environ[ENV_FLAG] = "1"  # processes the script starts (data-loader workers, helpers) get the same view
    install_as_deepspeed()
    sys.argv = list(argv)
    if as_module:
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
