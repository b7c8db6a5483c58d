"""DeepSpeed's public namespace over zeroshard (what ``import deepspeed`` gives after
:func:`zeroshard.install_as_deepspeed`). Every name is a zeroshard object or a thin adapter over one; see
:mod:`zeroshard.compat.alias` for how the alias is installed and docs/deepspeed-compat.md for the list."""

from zeroshard import __version__ as __zeroshard_version__
from zeroshard.config import ConfigError as DeepSpeedConfigError
from zeroshard.inference import init_inference
from zeroshard.runtime import add_config_arguments
from zeroshard.tensor_parallel import set_autotp_mode, tp_model_init

from ..alias import DEEPSPEED_API_VERSION
from . import (
    accelerator,
    checkpoint,
    checkpointing,
    comm,
    elasticity,
    git_version_info,
    module_inject,
    moe,
    monitor,
    ops,
    pipe,
    profiling,
    runtime,
    sequence,
    utils,
    zero,
)
from ._not_built import not_built
from .comm import init_distributed
from .runtime.config import DeepSpeedConfig
from .runtime.engine import DeepSpeedEngine, initialize
from .runtime.pipe.dualpipev import DualPipeVEngine, DualPipeVModule

_KERNELS = "DeepSpeed's fused CUDA transformer kernels are not built; the model's own layers train under ZeRO"
DeepSpeedTransformerLayer = not_built("deepspeed.DeepSpeedTransformerLayer", _KERNELS)
DeepSpeedTransformerConfig = not_built("deepspeed.DeepSpeedTransformerConfig", _KERNELS)

__version__ = version = DEEPSPEED_API_VERSION
__version_major__, __version_minor__, __version_patch__ = map(int, DEEPSPEED_API_VERSION.split("."))

__all__ = [
    "DeepSpeedConfig",
    "DeepSpeedConfigError",
    "DeepSpeedEngine",
    "DeepSpeedTransformerConfig",
    "DeepSpeedTransformerLayer",
    "DualPipeVEngine",
    "DualPipeVModule",
    "__version__",
    "__zeroshard_version__",
    "accelerator",
    "add_config_arguments",
    "checkpoint",
    "checkpointing",
    "comm",
    "elasticity",
    "git_version_info",
    "init_distributed",
    "init_inference",
    "tp_model_init",
    "set_autotp_mode",
    "initialize",
    "module_inject",
    "moe",
    "monitor",
    "ops",
    "pipe",
    "profiling",
    "runtime",
    "sequence",
    "utils",
    "version",
    "zero",
]
