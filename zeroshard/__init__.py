"""zeroshard: ZeRO-sharded data-parallel training for PyTorch with DeepSpeed-compatible configs.

Vocabulary used throughout the code:

- *original parameter*: the ``nn.Parameter`` the user's module owns; under ZeRO stages 0-2 its
  ``.data`` becomes a view into a flat buffer, so its identity never changes.
- *flat group*: a bucket of parameters packed back to back in one buffer, padded so the ranks of a
  shard group own equal contiguous slices (:mod:`zeroshard.zero.flat_group`).
- *shard*: one rank's slice of a flat group; for that slice the rank keeps the fp32 master weights and
  the optimizer state (:mod:`zeroshard.zero.optimizer_state`) and the reduced gradients
  (:mod:`zeroshard.zero.reducer`).
- *shard group* / *replica group*: named groups of the mesh of parallel dimensions (:mod:`zeroshard.comm.mesh`):
  ranks that split the state, and ranks that hold the same shard.
- *micro-step* / *boundary*: one ``backward`` per micro-batch; the optimizer runs at the
  gradient-accumulation boundary.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())  # a library configures no logging (see log.py)

# The public names, imported on first use: ``import zeroshard`` costs nothing until one is touched, so the
# ``zeroshard`` launcher (and ``--help``) starts without importing torch; torchrun's agent and the ranks import it.
_EXPORTS = {
    "ZeroshardEngine": "zeroshard.runtime",
    "add_config_arguments": "zeroshard.runtime",
    "initialize": "zeroshard.runtime",
    "init_distributed": "zeroshard.comm",
    "install_as_deepspeed": "zeroshard.compat",
    "estimate": "zeroshard.estimator",
    "init_empty_weights": "zeroshard.inference",
    "init_inference": "zeroshard.inference",
    "tp_model_init": "zeroshard.tensor_parallel",
    "set_autotp_mode": "zeroshard.tensor_parallel",
    "log_to_stdout": "zeroshard.log",
}
_SUBPACKAGES = ("checkpoint", "comm", "estimator", "inference", "ops", "zero")

__all__ = [
    "ZeroshardEngine",
    "__version__",
    "add_config_arguments",
    "checkpoint",
    "comm",
    "estimate",
    "estimator",
    "inference",
    "ops",
    "init_distributed",
    "init_empty_weights",
    "init_inference",
    "tp_model_init",
    "set_autotp_mode",
    "initialize",
    "install_as_deepspeed",
    "log_to_stdout",
    "zero",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBPACKAGES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
