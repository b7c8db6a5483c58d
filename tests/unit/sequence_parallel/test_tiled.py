"""TiledMLP: the same output bit for bit, the same gradients, and one tile's intermediates saved at a time."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from zeroshard.sequence_parallel import TiledMLP, agreed_tile_count, tiled_mlp

HIDDEN, TOKENS = 32, 64


def mlp() -> LlamaMLP:
    torch.manual_seed(0)
    return LlamaMLP(LlamaConfig(hidden_size=HIDDEN, intermediate_size=4 * HIDDEN))


def run(module, x, tiles=None):
    """Output, gradients (parameters, then input), and the most activation bytes saved for backward at once."""
    module.zero_grad()
    x = x.detach().requires_grad_(True)
    live, peak = [0], [0]
    params = {p.data_ptr() for p in module.parameters()}

    def pack(t):  # alive from here until backward reads it (each saved tensor is read once)
        nbytes = 0 if t.data_ptr() in params else t.numel() * t.element_size()
        live[0] += nbytes
        peak[0] = max(peak[0], live[0])
        return t, nbytes

    def unpack(packed):
        live[0] -= packed[1]
        return packed[0]

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = module(x) if tiles is None else tiled_mlp(module, x, tiles)
        out.backward(torch.ones_like(out))  # the backward's recomputations save too
    return out.detach(), [p.grad.clone() for p in module.parameters()] + [x.grad.clone()], peak[0]


@pytest.mark.parametrize("tiles", [1, 4, 7])
def test_tiles_give_the_same_output_and_gradients(tiles):
    module, x = mlp(), torch.randn(2, TOKENS, HIDDEN)
    out, grads, _ = run(module, x)
    tiled_out, tiled_grads, _ = run(module, x, tiles)
    assert torch.equal(out, tiled_out)
    for expected, got in zip(grads, tiled_grads):
        assert ((got - expected).norm() / expected.norm()).item() <= 1e-6


def test_four_tiles_save_a_quarter_of_the_intermediates():
    module, x = mlp(), torch.randn(2, TOKENS, HIDDEN)
    _, _, untiled = run(module, x)
    _, _, tiled = run(module, x, 4)
    assert untiled / tiled >= 3.5, (untiled, tiled)


@pytest.mark.parametrize("tiles", [0, -1, 2.0, True])
def test_a_bad_tile_count_is_named(tiles):
    with pytest.raises(ValueError, match="tiles must be an integer >= 1"):
        TiledMLP.apply(lambda m, t: m(t), mlp(), torch.randn(1, 4, HIDDEN), tiles, None)


def test_tile_counts_without_a_group():
    assert agreed_tile_count(1000, 256) == 4 and agreed_tile_count(0, 256) == 1
    with pytest.raises(ValueError):
        agreed_tile_count(10, 0)
