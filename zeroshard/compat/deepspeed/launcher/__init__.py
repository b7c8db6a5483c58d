"""``deepspeed.launcher``: names other launchers (``accelerate launch``) read from DeepSpeed's."""

from . import runner

__all__ = ["runner"]
