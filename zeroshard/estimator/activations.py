"""What autograd keeps for backward, measured by one forward on meta tensors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn


@dataclass
class Activations:
    saved: int  # what autograd keeps after forward (parameters and their views excluded)
    largest_saved: int  # the largest one of those tensors
    recompute: int  # under activation checkpointing: what one block allocates when backward recomputes it


def activation_peak(micro_batches: list[Activations], largest_grad: int) -> int:
    """The activation bytes of a step whose ``micro_batches`` all finish forward before backward starts (one, or
    every micro-batch of a ``layer_major`` step): what each keeps, one block's recomputation, and backward's first
    working set (the gradients of the largest saved tensor, the logits in a language model, and of its input, while
    the largest parameter's fresh gradient, ``largest_grad`` bytes, waits to be staged)."""
    return (
        sum(a.saved for a in micro_batches)
        + max((a.recompute for a in micro_batches), default=0)
        + 2 * max((a.largest_saved for a in micro_batches), default=0)
        + largest_grad
    )


def trace_activations(model: nn.Module, sample_inputs: Any, stand_ins: Optional[dict] = None) -> Activations:
    """One forward on meta tensors. Saved-tensor hooks count what autograd keeps for backward; a dispatch mode
    counts what each repeated block allocates. A block that saves no more than its inputs runs under activation
    checkpointing (``torch.utils.checkpoint`` installs its own hooks inside and keeps only the block's inputs):
    backward recomputes it, re-allocating its forward at once. ``stand_ins``: meta tensors by name for the
    parameters and buffers of a model that is not on the meta device (a training engine's, whose stage-3
    parameters hold no data between steps); the forward runs on them through ``torch.func.functional_call``."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from ..zero.stage3.units import repeated_block_classes

    params = {id(p) for p in (model.parameters() if stand_ins is None else stand_ins.values())}
    seen: set[int] = set()
    saved, largest = [0], [0]
    block_saved: dict[int, int] = {}
    block_allocated: dict[int, int] = {}
    current: list[Optional[int]] = [None]

    def pack(t: torch.Tensor):
        base = t._base if t._base is not None else t
        if id(t) in params or id(base) in params or id(base) in seen:
            return t
        seen.add(id(base))
        nbytes = base.numel() * base.element_size()
        saved[0] += nbytes
        largest[0] = max(largest[0], nbytes)
        if current[0] is not None:
            block_saved[current[0]] = block_saved.get(current[0], 0) + nbytes
        return t

    class CountAllocations(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
                # a data-dependent check (``.item()``, ``bool(mask.all())``) on meta data: the trace assumes
                # unpadded, unpacked inputs, so a boolean reads True and a number 0
                return True if args[0].dtype == torch.bool else 0
            out = func(*args, **(kwargs or {}))
            if current[0] is not None:
                inputs = {a.untyped_storage()._cdata for a in tree_leaves((args, kwargs)) if torch.is_tensor(a)}
                fresh = (t for t in tree_leaves(out) if torch.is_tensor(t))
                nbytes = sum(t.untyped_storage().nbytes() for t in fresh if t.untyped_storage()._cdata not in inputs)
                block_allocated[current[0]] = block_allocated.get(current[0], 0) + nbytes
            return out

    classes = repeated_block_classes(model)
    blocks = [m for m in model.modules() if type(m).__name__ in classes]
    block_inputs: dict[int, int] = {}

    def enter(i: int, args) -> None:
        current[0] = i
        block_inputs[i] = sum(a.numel() * a.element_size() for a in tree_leaves(args) if torch.is_tensor(a))

    handles = [m.register_forward_pre_hook(lambda mod, args, i=i: enter(i, args)) for i, m in enumerate(blocks)] + [
        m.register_forward_hook(lambda mod, args, out: current.__setitem__(0, None)) for m in blocks
    ]
    args, kwargs = _split(sample_inputs)
    to_meta = lambda v: v.to("meta") if torch.is_tensor(v) else v  # noqa: E731
    args = tuple(to_meta(a) for a in args)
    kwargs = {k: to_meta(v) for k, v in kwargs.items()}
    try:
        with CountAllocations(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if stand_ins is None:
                output = model(*args, **kwargs)
            else:
                output = torch.func.functional_call(model, stand_ins, args, kwargs)
    finally:
        for handle in handles:
            handle.remove()
    del output
    recompute = max((n for i, n in block_allocated.items() if block_saved.get(i, 0) <= block_inputs[i]), default=0)
    return Activations(saved[0], largest[0], recompute)


def _split(sample_inputs: Any) -> tuple[tuple, dict]:
    if isinstance(sample_inputs, dict):
        return (), dict(sample_inputs)
    if isinstance(sample_inputs, (tuple, list)):
        return tuple(sample_inputs), {}
    return (sample_inputs,), {}
