"""DeepSpeed's engine hooks its clients call or replace after ``initialize``, beside the loop: an optimizer given
to an engine built without one (``_configure_optimizer``), the reduction dtype set later
(``communication_data_type``), and the points DeepSpeed's engine calls that clients patch on the class
(``_broadcast_model``, ``clip_fp32_gradients``, ``_report_progress``: diffusion-pipe replaces all three). A base class
of :class:`~zeroshard.runtime.engine.ZeroshardEngine`; the engine calls the patch points where DeepSpeed's does."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .. import comm
from ..precision import DTYPE_NAMES
from ..zero import ZeroOptimizer
from ..zero.stack import NoOptimizerStack


class ClientHooks:
    """See the module."""

    def _configure_optimizer(self, client_optimizer: Any, model_parameters: Any) -> None:
        """DeepSpeed's: give an engine built without an optimizer one after ``initialize`` (diffusion-pipe builds
        its optimizer from the engine's grid this way): ``client_optimizer`` is an optimizer, a callable
        ``params -> optimizer`` or None (the config's ``optimizer`` block); the ZeRO stack is built over it as
        ``initialize`` would have, and ``engine.optimizer`` is its view."""
        if self._attach_optimizer is None or not isinstance(self.stack, NoOptimizerStack):
            raise RuntimeError(
                f"rank {comm.get_rank()}: engine._configure_optimizer(): this engine already has an optimizer (its "
                "state lives in the ZeRO stack); pass the optimizer to initialize, or call this once on an engine "
                "built without one"
            )
        if client_optimizer is None and self.settings.optimizer is None:
            raise ValueError(
                "engine._configure_optimizer(None, ...): no optimizer given and the config has no 'optimizer' block"
            )
        self.stack = self._attach_optimizer(client_optimizer, model_parameters)
        self._attach_optimizer = None
        self.reporting.stack = self.stack
        self._optimizer = ZeroOptimizer(self.stack)

    @property
    def communication_data_type(self) -> torch.dtype:
        """The dtype gradients are reduced in (the config's ``communication_data_type``; by default the compute
        dtype)."""
        return self.policy.reduce

    @communication_data_type.setter
    def communication_data_type(self, value: Any) -> None:
        """Set after ``initialize``, as DeepSpeed's engine allows (diffusion-pipe sets its model's dtype): a torch
        floating dtype or a config name (``"bf16"``, ``"fp32"``, ...); the next backward's reductions use it."""
        dtype = DTYPE_NAMES.get(value) if isinstance(value, str) else value
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(
                f"engine.communication_data_type = {value!r}: torch.float32, torch.bfloat16 or torch.float16 (or "
                f"one of {sorted(DTYPE_NAMES)})"
            )
        if self.stack.reducer is not None:
            self.stack.reducer.set_reduce_dtype(dtype)
        self.policy = dataclasses.replace(self.policy, reduce=dtype)

    def _broadcast_model(self) -> None:
        """DeepSpeed's hook at engine construction, which ``deepspeed.initialize`` calls where DeepSpeed's engine
        does (diffusion-pipe replaces it to skip frozen weights). The ranks already started from the first one's
        weights in ``initialize``, before ZeRO flattened them: nothing is left to broadcast here."""

    @property
    def seq_data_parallel_group(self) -> comm.Group:
        """DeepSpeed's name for the ranks gradients are averaged over (data x sequence parallel): the mesh's
        gradient group (``deepspeed.comm``'s calls take it as a group)."""
        return self.mesh.gradient

    def clip_fp32_gradients(self) -> None:
        """DeepSpeed's hook before an fp32 step without ZeRO when ``gradient_clipping`` is set (diffusion-pipe
        replaces it so a stage without trainable parameters does not fail), called at the same point. Here the
        reduced gradients live in the stack's flat buffers, not in each parameter's ``.grad``, and the step clips
        them there by the global norm, as DeepSpeed's own would; a replacement that clips ``.grad`` finds none."""

    def _report_progress(self, step: int) -> None:
        """DeepSpeed's hook for the line printed every ``steps_per_print`` steps (diffusion-pipe replaces it to print
        less): the loss, learning rate, norm, throughput and exposed waits of the last steps."""
        self.reporting.report(self._last_loss)
