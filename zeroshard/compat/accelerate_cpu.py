"""DeepSpeed on CPU ranks for Accelerate (and so for the HF Trainer, which runs DeepSpeed through Accelerate).

Accelerate picks its process-group backend from the devices it finds (NCCL for CUDA, ...) and starts DeepSpeed
only on such a device: on a machine without one it leaves the backend empty and runs one process, however many
ranks were launched. zeroshard trains on CPU ranks with Gloo, so in compatibility mode, and only where no GPU is
visible, Accelerate's backend choice gets one more case: a DeepSpeed run (``ACCELERATE_USE_DEEPSPEED``) under a
launcher (``LOCAL_RANK``) with nothing found uses ``gloo``. Everything after that is Accelerate's own path.

Applied when ``accelerate.state`` is imported in a process where :func:`zeroshard.install_as_deepspeed` ran."""

from __future__ import annotations

import functools
import os

MODULE = "accelerate.state"


def applies() -> bool:
    from zeroshard.accelerator import get_accelerator

    return get_accelerator().name == "cpu"


def adapt(state_module) -> None:
    """Wrap ``PartialState._prepare_backend`` in the freshly imported ``accelerate.state`` module."""
    cls = state_module.PartialState
    original = cls._prepare_backend

    @functools.wraps(original)
    def prepare_backend(self, cpu: bool = False, sagemaker_dp=False, backend=None):
        chosen, distributed_type = original(self, cpu, sagemaker_dp, backend)
        deepspeed_run = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
        if chosen is None and deepspeed_run and not cpu and int(os.environ.get("LOCAL_RANK", -1)) != -1:
            chosen = "gloo"
        return chosen, distributed_type

    cls._prepare_backend = prepare_backend
