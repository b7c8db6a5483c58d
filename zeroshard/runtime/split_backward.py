"""A backward pass in two halves, for the zero-bubble pipeline schedules: the input gradients first (B: what the
previous stage waits for), the weight gradients later (W: what nobody waits for, run where the stage would idle).
Together they do the work of one backward, no operation twice (``tests/unit/runtime/test_split_backward.py`` counts
the FLOPs), and give the same gradients bit for bit.

How, on autograd's graph (the approach of the zero-bubble paper, arXiv 2401.10241, and torch's pipelining):

- the *input path* is every node of the graph from which a stage input's gradient node is reachable. B runs
  ``backward(outputs, inputs=stage inputs, retain_graph=True)``: autograd executes only input-path nodes, and each
  of them computes only the outputs the inputs need (a matmul's input gradient, not its weight gradient);
- a *join* is an input-path node with an edge off the path (to a weight, or to nodes leading only to weights). B
  captures the gradient arriving at each join (a pre-hook);
- W runs each join again from its captured gradient, asking only for the gradients at its off-path edges (autograd
  computes only those outputs of it, and follows none of its input-path edges: earlier layers, or a weight used
  before, lie below them), then back-propagates everything below those edges, which leads only to weights, in one
  call. Outputs not on the input path at all (the first stage has no inputs needing gradients) are back-propagated
  whole in W.

The weights' gradients accumulate in W, so ZeRO's gradient hooks fire there (and reduce at the last micro-batch's
W). Under ``use_reentrant=False`` activation checkpointing a region would be recomputed in both halves; the schedules
using this refuse activation checkpointing and ZeRO-3 (whose gathered weights backward re-gathers) by name."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge


@dataclass
class WeightWork:
    """What W needs of one micro-batch after B: per join, the gradient captured and the weights below it; the
    outputs off the input path with their gradients."""

    joins: list[tuple[Any, tuple, list]] = field(default_factory=list)
    off_path: list[tuple[torch.Tensor, Optional[torch.Tensor]]] = field(default_factory=list)
    # a weight reached from two joins (used twice in the stage): W back-propagates the outputs again instead
    whole: Optional[tuple[list, Optional[list], list]] = None

    def run(self) -> None:
        """W: every weight gradient of the micro-batch, accumulated into ``.grad``. Each join is run alone, asked
        only for the gradients at its off-path edges (so none of its input-path edges is followed: an earlier
        layer, or a weight used before, lies below them); then everything below those edges, which leads only to
        weights, in one call."""
        if self.whole is not None:
            outputs, grads, weights = self.whole
            torch.autograd.backward(outputs, grads, inputs=weights)
            self.whole = None
            return
        below: dict = {}  # off-path edge -> its gradient, summed over the joins reaching it
        for node, grads, edges in self.joins:
            seeds = [(GradientEdge(node, i), g) for i, g in enumerate(grads) if g is not None]
            if not seeds:
                continue
            targets = [GradientEdge(child, k) for child, k in edges]
            got = torch.autograd.grad([e for e, _ in seeds], targets, [g for _, g in seeds], allow_unused=True)
            for (child, k), grad in zip(edges, got):
                if grad is not None:
                    below[(child, k)] = grad if (child, k) not in below else below[(child, k)] + grad
        roots = [(GradientEdge(child, k), grad) for (child, k), grad in below.items()]
        roots += [(t, g) for t, g in self.off_path]
        if roots:
            grads = [g for _, g in roots]
            torch.autograd.backward([r for r, _ in roots], None if all(g is None for g in grads) else grads)
        self.joins, self.off_path = [], []


def backward_input(
    outputs: list[torch.Tensor], grads: Optional[list[torch.Tensor]], inputs: list[torch.Tensor]
) -> WeightWork:
    """B: the gradients of ``inputs`` (leaves requiring grad) into their ``.grad``, from ``outputs`` with ``grads``
    (None: scalar losses); returns what W needs."""
    grads = list(grads) if grads is not None else [None] * len(outputs)
    on_path = _input_path([o.grad_fn for o in outputs], {get_gradient_edge(x).node for x in inputs})
    work, captured, handles = WeightWork(), {}, []
    for node in on_path:
        off = [(child, k) for child, k in node.next_functions if child is not None and child not in on_path]
        if off:
            work.joins.append((node, (), off))
            handles.append(node.register_prehook(lambda grads_in, node=node: captured.__setitem__(node, grads_in)))
    try:
        if inputs:
            torch.autograd.backward(outputs, None if grads[0] is None else grads, inputs=inputs, retain_graph=True)
    finally:
        for handle in handles:
            handle.remove()
    work.joins = [(node, captured[node], edges) for node, _, edges in work.joins if node in captured]
    work.off_path = [(o, g) for o, g in zip(outputs, grads) if o.grad_fn is not None and o.grad_fn not in on_path]
    below = [_subgraph([child for child, _ in edges]) for _, _, edges in work.joins]
    if sum(len(nodes) for nodes in below) != len(set().union(*below)):
        # the same weight (or weight-only node) below two joins: running one join alone would follow its input
        # path down to the other (autograd needs it for that weight) and run it twice. W then back-propagates the
        # outputs again from the retained graph into the weights only: exact, the input path's work done twice.
        weights = [n.variable for n in set().union(*below, *(_subgraph([o.grad_fn]) for o, _ in work.off_path))
                   if getattr(n, "variable", None) is not None]  # fmt: skip
        work.whole = (outputs, None if grads[0] is None else grads, weights)
    return work


def _input_path(roots: list, input_nodes: set) -> set:
    """The nodes reachable from ``roots`` from which one of ``input_nodes`` is reachable."""
    reaches: dict = {}
    stack = [(node, False) for node in roots if node is not None]
    while stack:  # iterative post-order: deep graphs would overflow Python's recursion
        node, expanded = stack.pop()
        if node in reaches and not expanded:
            continue
        children = [child for child, _ in node.next_functions if child is not None]
        if not expanded:
            reaches[node] = False
            stack.append((node, True))
            stack.extend((child, False) for child in children if child not in reaches)
        else:
            reaches[node] = node in input_nodes or any(reaches.get(child, False) for child in children)
    return {node for node, hit in reaches.items() if hit}


def _subgraph(roots: list) -> set:
    """Every node reachable from ``roots``."""
    seen, stack = set(), [node for node in roots if node is not None]
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(child for child, _ in node.next_functions if child is not None)
    return seen
