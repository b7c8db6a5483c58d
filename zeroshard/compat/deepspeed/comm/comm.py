"""``deepspeed.comm.comm``: the module whose names ``deepspeed.comm`` re-exports (diffusion-pipe imports it as
``import deepspeed.comm.comm as dist``); the same functions."""

from . import *  # noqa: F403
from . import __all__  # noqa: F401
