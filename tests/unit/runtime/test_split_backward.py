"""The backward pass in two halves (``zeroshard.runtime.split_backward``): B gives the input gradients and touches no
weight, W then gives every weight gradient; together bit for bit one backward, and exactly its FLOPs (no operation
runs twice), on a stage inside a pipeline (inputs needing gradients), the first stage (none: W does it all), the
last (a scalar loss) and a weight used twice."""

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from zeroshard.runtime.split_backward import backward_input

DIM = 32


class Tied(nn.Module):
    """A weight used twice (its gradient the sum of both uses) beside an ordinary block."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, x):
        return self.shared(torch.relu(self.shared(self.norm(x))))


def stage(tied: bool = False) -> nn.Module:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(DIM, DIM), nn.GELU(), nn.LayerNorm(DIM)) for _ in range(3)]
    return nn.Sequential(*blocks, *([Tied()] if tied else []))


def flops(fn) -> int:
    mode = FlopCounterMode(display=False)
    with mode:
        fn()
    return mode.get_total_flops()


def run(kind: str, tied: bool = False):
    """Once as one backward, once split; returns both gradients (weights, then inputs) and the FLOPs."""
    model = stage(tied)
    x = torch.randn(8, DIM, requires_grad=kind != "first")
    g = torch.randn(8, DIM)
    results = []
    for split in (False, True):
        model.zero_grad()
        x.grad = None
        out = model(x)
        outputs, grads = ([out.square().mean()], None) if kind == "last" else ([out], [g])
        inputs = [x] if x.requires_grad else []
        if split:
            work = {}

            def first_half(work=work, outputs=outputs, grads=grads, inputs=inputs):
                work["w"] = backward_input(outputs, grads, inputs)

            b = flops(first_half)
            after_b = [p.grad for p in model.parameters()]
            w = flops(work["w"].run)
            results.append(([p.grad.clone() for p in model.parameters()], x.grad, (b, w), after_b))
        else:
            total = flops(lambda outputs=outputs, grads=grads: torch.autograd.backward(outputs, grads))
            results.append(([p.grad.clone() for p in model.parameters()], x.grad, total, None))
    return results


def test_the_halves_give_one_backwards_gradients_and_flops_bit_for_bit():
    for kind in ("middle", "first", "last"):
        (weights, x_grad, total, _), (split_weights, split_x_grad, (b, w), after_b) = run(kind)
        assert all(torch.equal(a, c) for a, c in zip(weights, split_weights)), kind
        assert (x_grad is None and split_x_grad is None) or torch.equal(x_grad, split_x_grad), kind
        assert all(g is None for g in after_b), kind  # B touched no weight
        assert b + w == total, (kind, b, w, total)
        if kind == "first":
            assert b == 0  # nothing to send back: W is the whole backward
        else:
            assert 0 < b < total and 0 < w < total


def test_a_weight_used_twice_in_the_stage_gets_both_uses_exactly():
    """Running one join alone would reach the other through the input path: W back-propagates the outputs again
    (into the weights only), exact, at the input path's cost once more."""
    (weights, x_grad, total, _), (split_weights, split_x_grad, (b, w), after_b) = run("middle", tied=True)
    assert all(torch.equal(a, c) for a, c in zip(weights, split_weights))
    assert torch.equal(x_grad, split_x_grad) and all(g is None for g in after_b)
    assert b + w > total
