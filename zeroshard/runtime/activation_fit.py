"""Whether a layer-major step's activations fit, measured before the step runs (``zero_optimization.layer_major``).

A layer-major step keeps the activations of all its micro-batches for backward at once (Note [layer-major] in
zero/stage3/layer_major.py), as one micro-batch as large as the whole step would. Finding that out from an
out-of-memory error halfway through the first step's forward is too late to say why, so ``train_batch`` measures
first: each micro-batch shape is traced once on meta tensors (``zeroshard estimate``'s trace: what autograd
saves, nothing allocated), and the step's bytes are compared with what the rank can still allocate. The ranks
compare their verdicts in the collective that agrees on the step's micro-batches, so a step that does not fit on
one rank is refused on all of them, before anything runs."""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
from torch.utils._pytree import tree_leaves, tree_map

from ..accelerator import get_accelerator
from ..estimator.activations import Activations, activation_peak, trace_activations
from ..zero.sharded_param import records_of
from ..zero.stage3 import Stage3Runtime
from .micro_batches import StepMemory


class ActivationFit:
    """Measures layer-major steps of ``module`` (wrapped by ``stage3``) against the device's free memory; keeps the
    trace of each micro-batch shape it has seen (the most recent ``remembered``)."""

    def __init__(self, module: torch.nn.Module, stage3: Stage3Runtime, compute: torch.dtype, remembered: int = 64):
        self.module, self.stage3, self.compute, self.remembered = module, stage3, compute, remembered
        self._traced: dict[tuple, Activations] = {}
        self._untraceable = False  # a trace failed once: the model's forward cannot run on meta tensors
        trained = [p for p in self._stand_ins().values() if p.requires_grad]
        self._largest_grad = max((p.numel() * p.element_size() for p in trained), default=0)  # a fresh gradient
        self._gathered = stage3.gathered_bytes_at_most()  # fixed by the units and the live budget: counted once

    def measure(self, batches: list) -> Optional[StepMemory]:
        """The step's bytes against this rank's free memory; None when the forward cannot be traced on meta tensors
        (it communicates, or reads values): that step runs unmeasured, after a warning."""
        if self._untraceable:
            return None
        try:
            traces = [self._trace(batch) for batch in batches]
        except Exception as error:  # the model's own code on meta tensors: anything it raises means "cannot trace"
            self._untraceable = True
            warnings.warn(
                "zero_optimization.layer_major: the activations of a micro-batch could not be measured on meta tensors "
                f"before the step ({type(error).__name__}: {error}); steps run without the check that they fit",
                stacklevel=3,
            )
            return None
        activations = activation_peak(traces, self._largest_grad)
        needed = activations + self._gathered
        return StepMemory(needed, get_accelerator().allocatable_memory(), activations, len(batches))

    def _trace(self, batch: Any) -> Activations:
        key = _signature(batch)
        if key not in self._traced:
            with self.stage3.paused(), torch.enable_grad():
                self._traced[key] = trace_activations(self.module, tree_map(self._as_input, batch), self._stand_ins())
            if len(self._traced) > self.remembered:
                self._traced.pop(next(iter(self._traced)))
        return self._traced[key]

    def _as_input(self, value: Any) -> Any:
        """A micro-batch's tensor as the engine's forward passes it (floating point in the compute dtype), on meta."""
        if not torch.is_tensor(value):
            return value
        return value.to("meta", self.compute if value.is_floating_point() else value.dtype)

    def _stand_ins(self) -> dict[str, torch.Tensor]:
        """Meta tensors shaped as the module's parameters (whole, as gathered) and buffers."""
        stand_ins = {}
        for name, param in self.module.named_parameters():
            records = records_of(param)
            shape = records.full_shape(param) if records is not None else param.shape
            stand_ins[name] = torch.empty(shape, dtype=param.dtype, device="meta", requires_grad=param.requires_grad)
        for name, buffer in self.module.named_buffers():
            stand_ins[name] = torch.empty_like(buffer, device="meta")
        return stand_ins


def _signature(batch: Any) -> tuple:
    """What a micro-batch's trace depends on: its tensors' shapes and dtypes, and its plain values."""
    return tuple(
        (tuple(leaf.shape), leaf.dtype) if torch.is_tensor(leaf) else leaf if isinstance(leaf, _PLAIN) else type(leaf)
        for leaf in tree_leaves(batch)
    )


_PLAIN = (int, float, bool, str, type(None))
