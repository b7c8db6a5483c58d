"""How long each layer of a pipeline takes, measured: the weights of ``partition_method="time"``.

Parameter counts balance memory, not time: a head with a loss over a large vocabulary, an attention layer on long
sequences or a parameter-free function take time no count shows, and the stage waiting on the slowest one idles
(1F1B's bubble grows past its formula). So each layer is built alone (a ``LayerSpec`` one at a time, as the
parameter count builds them), run forward on the previous layer's output and backward from a gradient of its output,
the last layer with the loss on the labels; the fastest of ``repeats`` runs counts (the first warms up). Only one
layer and one micro-batch's activations are alive at a time."""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from .spec import LayerSpec, TiedLayerSpec


def layer_times(
    specs: list, batch: tuple, loss_fn: Optional[Callable], repeats: int = 3, seed: Optional[int] = None
) -> list[float]:
    """Seconds of forward + backward of each of ``specs`` on one micro-batch ``batch = (inputs, labels)``
    (``seed``: ``torch.manual_seed(seed + index)`` before building layer ``index``, as ``seed_layers`` does)."""
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise ValueError("partition_method='time' profiles one micro-batch: profile_batch=(inputs, labels)")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 2:
        raise ValueError(f"repeats must be an int >= 2 (the first run warms up), got {repeats!r}")
    inputs, labels = batch
    tied: dict[str, nn.Module] = {}
    times = []
    for index, spec in enumerate(specs):
        if seed is not None:
            torch.manual_seed(seed + index)
        layer = _built(spec, tied)
        last = index == len(specs) - 1
        runs = [_run_once(layer, inputs, labels if last else None, loss_fn if last else None) for _ in range(repeats)]
        times.append(min(seconds for seconds, _ in runs[1:]))
        inputs = runs[-1][1]
        if not isinstance(spec, TiedLayerSpec):
            del layer
    return times


def _built(spec: Any, tied: dict) -> Callable:
    if isinstance(spec, TiedLayerSpec):
        if spec.key not in tied:
            tied[spec.key] = spec.build()
        module = tied[spec.key]
        return module if spec.forward_fn is None else (lambda x, m=module, f=spec.forward_fn: f(m, x))
    return spec.build() if isinstance(spec, LayerSpec) else spec


def _run_once(layer: Callable, inputs: Any, labels: Any, loss_fn: Optional[Callable]) -> tuple[float, Any]:
    """Seconds of one forward and backward of ``layer``; and its output, detached, as the next layer's input."""
    inputs = tree_map(lambda t: t.detach().requires_grad_(t.is_floating_point()) if torch.is_tensor(t) else t, inputs)
    started = time.perf_counter()
    output = layer(inputs)
    result = loss_fn(output, labels) if loss_fn is not None else output
    tensors = [t for t in tree_flatten(result)[0] if torch.is_tensor(t) and t.requires_grad]
    if tensors:
        torch.autograd.backward(tensors, [torch.ones_like(t) for t in tensors])
    seconds = time.perf_counter() - started
    if isinstance(layer, nn.Module):
        layer.zero_grad(set_to_none=True)
    return seconds, tree_map(lambda t: t.detach() if torch.is_tensor(t) else t, output)
