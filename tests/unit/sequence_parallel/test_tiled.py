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


VOCAB = 100


def head_and_batch():
    torch.manual_seed(0)
    return (
        torch.nn.Linear(HIDDEN, VOCAB, bias=False),
        torch.randn(2, TOKENS, HIDDEN),
        torch.randint(0, VOCAB, (2, TOKENS)),
    )


def cross_entropy(head, x, y):
    return torch.nn.functional.cross_entropy(head(x), y)


def masked_sum(head, x, y, mask):
    losses = torch.nn.functional.cross_entropy(head(x), y, reduction="none")
    return (losses * mask).sum()


def logits_run(tiles, reduction="mean", mask=None):
    """Loss, gradients (head, input) and the most logits bytes saved for backward at once (each storage once)."""
    from zeroshard.sequence_parallel import TiledFusedLogitsLoss

    head, x, y = head_and_batch()
    x.requires_grad_(True)
    live: dict[int, list[int]] = {}  # storage -> [times saved and not yet read, bytes]
    peak = [0]

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if t.dim() < 2 or t.shape[-1] != VOCAB or key == head.weight.untyped_storage().data_ptr():
            return t, None  # not logits (the head's weight is saved transposed)
        entry = live.setdefault(key, [0, t.untyped_storage().nbytes()])
        entry[0] += 1
        peak[0] = max(peak[0], sum(nbytes for _, nbytes in live.values()))
        return t, key

    def unpack(packed):
        t, key = packed
        if key is not None and key in live:
            live[key][0] -= 1
            if live[key][0] == 0:
                del live[key]
        return t

    fn = masked_sum if mask is not None else cross_entropy
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        if tiles is None:
            args = (x.reshape(-1, HIDDEN), y.reshape(-1)) + ((mask.reshape(-1),) if mask is not None else ())
            loss = fn(head, *args)
        else:
            loss = TiledFusedLogitsLoss.apply(fn, head, x, y, mask, tiles, None, reduction)
        loss.backward()
    return loss.detach(), [head.weight.grad, x.grad], peak[0]


def test_the_tiled_loss_equals_the_whole_one_and_keeps_one_tiles_logits():
    loss, grads, whole = logits_run(None)
    tiled_loss, tiled_grads, tiled = logits_run(4)
    assert torch.allclose(tiled_loss, loss, rtol=1e-6)
    for expected, got in zip(grads, tiled_grads):
        assert ((got - expected).norm() / expected.norm()).item() <= 1e-6
    assert 0 < tiled <= whole // 4  # what one tile's logits and their softmax take, never more at once


def test_a_masked_sum_over_tiles_is_the_whole_masked_sum():
    mask = (torch.arange(2 * TOKENS).view(2, TOKENS) % 3 != 0).float()
    mask[0] = 0  # a tile whose tokens are all masked contributes zero
    loss, grads, _ = logits_run(None, mask=mask)
    tiled_loss, tiled_grads, _ = logits_run(4, "sum", mask)
    assert torch.allclose(tiled_loss, loss, rtol=1e-6)
    for expected, got in zip(grads, tiled_grads):
        assert ((got - expected).norm() / expected.norm()).item() <= 1e-6


@pytest.mark.parametrize(
    "change,message",
    [
        ({"reduction": "max"}, "output_reduction 'max'"),
        ({"tiles": 0}, "tiles must be an integer >= 1"),
        ({"y": torch.zeros(2, 3, dtype=torch.long)}, r"need the same \[batch, sequence\] dims"),
        ({"mask": torch.ones(3)}, r"mask \[3\] must be"),
    ],
)
def test_bad_arguments_are_named(change, message):
    from zeroshard.sequence_parallel import TiledFusedLogitsLoss

    head, x, y = head_and_batch()
    args = {"y": y, "mask": None, "tiles": 2, "reduction": "mean", **change}
    with pytest.raises(ValueError, match=message):
        TiledFusedLogitsLoss.apply(
            cross_entropy, head, x, args["y"], args["mask"], args["tiles"], None, args["reduction"]
        )


def test_sequence_tiled_compute_matches_the_untiled_function():
    """DeepSpeed's general form: sharded and passed keyword arguments, outputs joined on dim 1 or stacked (one
    loss per tile) then reduced; the input's gradient and the parameters' equal the untiled ones."""
    from zeroshard.sequence_parallel import sequence_tiled_compute

    torch.manual_seed(0)
    head = torch.nn.Linear(HIDDEN, 16)
    x, y = torch.randn(1, TOKENS, HIDDEN, requires_grad=True), torch.randint(0, 16, (1, TOKENS))

    def loss_fn(x, y, scale):
        return torch.nn.functional.cross_entropy(head(x).flatten(0, 1), y.flatten()) * scale

    def grads(loss):
        head.zero_grad()
        x.grad = None
        loss.backward()
        return loss.item(), x.grad.clone(), head.weight.grad.clone()

    expected = grads(loss_fn(x, y, 2.0))
    got = grads(sequence_tiled_compute(loss_fn, TOKENS, 4, {"x": x, "y": y}, {"scale": 2.0}, "x", None, 0, "mean"))
    assert abs(got[0] - expected[0]) <= 1e-6 * expected[0]
    for want, have in zip(expected[1:], got[1:]):
        assert ((have - want).norm() / want.norm()).item() <= 1e-6
    with pytest.raises(ValueError, match="grad_requiring_tensor_key 'y' is not one of \\['x'\\]"):
        sequence_tiled_compute(loss_fn, TOKENS, 4, {"x": x}, {"y": y, "scale": 1.0}, "y")
    with pytest.raises(ValueError, match="output_reduction 'max'"):
        sequence_tiled_compute(loss_fn, TOKENS, 4, {"x": x, "y": y}, {"scale": 1.0}, "x", output_reduction="max")
