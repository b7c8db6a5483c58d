"""zeroshard: ZeRO-sharded data-parallel training for PyTorch with DeepSpeed-compatible configs.

Vocabulary used throughout the code:

- *original parameter*: the ``nn.Parameter`` the user's module owns; under ZeRO stages 0-2 its
  ``.data`` becomes a view into a flat buffer, so its identity never changes.
- *flat group*: a bucket of parameters packed back to back in one buffer, padded so the ranks of a
  shard group own equal contiguous slices (:mod:`zeroshard.zero.flat_group`).
- *shard*: one rank's slice of a flat group; for that slice the rank keeps the fp32 master weights and
  the optimizer state (:mod:`zeroshard.zero.optimizer_state`) and the fp32 reduced gradients
  (:mod:`zeroshard.zero.reducer`).
- *shard group* / *replica group*: rows and columns of the rank grid (:mod:`zeroshard.comm.groups`):
  ranks that split the state, and ranks that hold the same shard.
- *micro-step* / *boundary*: one ``backward`` per micro-batch; the optimizer runs at the
  gradient-accumulation boundary.
"""

from . import checkpoint, comm, estimator, inference, ops, zero
from .comm import init_distributed
from .compat import install_as_deepspeed
from .estimator import estimate
from .inference import init_empty_weights, init_inference
from .log import log_to_stdout
from .runtime import ZeroshardEngine, add_config_arguments, initialize

__version__ = "0.1.0"

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
    "initialize",
    "install_as_deepspeed",
    "log_to_stdout",
    "zero",
]
