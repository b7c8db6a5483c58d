"""Lightning's precision hooks for a zeroshard engine: the engine owns loss scaling, casting and clipping."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable

from lightning.pytorch.plugins.precision import Precision
from torch import Tensor


class ZeroshardPrecision(Precision):
    """The Trainer's ``precision`` (``"32-true"``, ``"16-mixed"``, ``"bf16-mixed"``) becomes the engine's fp16/bf16
    config; this plugin only routes backward and step to the engine.

    Lightning divides the loss by ``accumulate_grad_batches`` before ``backward`` for every strategy, so the
    engine is told not to divide again (DeepSpeed's own Lightning strategy divides twice)."""

    def __init__(self, precision: str = "32-true") -> None:
        self.precision = precision

    def backward(self, tensor: Tensor, model, optimizer, *args: Any, **kwargs: Any) -> None:
        model.trainer.model.backward(tensor, *args, scale_wrt_gas=False, **kwargs)

    def optimizer_step(self, optimizer, model, closure: Callable[[], Any], **kwargs: Any) -> Any:
        result = closure()
        self._after_closure(model, optimizer)
        if model.automatic_optimization and result is None:
            raise RuntimeError("training_step returned None (skipping backward), which zeroshard does not support")
        model.trainer.model.step()  # applies the optimizer at accumulation boundaries only
        return result

    def clip_gradients(self, optimizer, clip_val=0.0, gradient_clip_algorithm=None) -> None:
        """The engine clips by the global norm (``gradient_clipping`` from ``Trainer(gradient_clip_val=...)``)."""

    def forward_context(self):
        return nullcontext()  # the engine casts inputs and holds parameters in the compute dtype

    def convert_input(self, data: Any) -> Any:
        return data

    def tensor_init_context(self):
        return nullcontext()

    def module_init_context(self):
        return nullcontext()
