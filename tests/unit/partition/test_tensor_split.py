"""TensorSplit: cutting a full tensor into tensor-parallel pieces and joining them back, for every layout the
layers use (Linear column / row, GPT-2's fused and transposed Conv1D), and its manifest record refused when edited."""

import pytest
import torch

from zeroshard.partition import TensorSplit

SPLITS = [
    ((12, 8), TensorSplit(0, 2)),  # Linear column: output features
    ((8, 12), TensorSplit(1, 4)),  # Linear row: input features
    ((8, 24), TensorSplit(1, 2, fused=3, transposed=True)),  # GPT-2 c_attn: (in, 3 x out), stored (out, in)
    ((24,), TensorSplit(0, 2, fused=3)),  # its bias
    ((8, 16), TensorSplit(0, 2, transposed=True)),  # GPT-2 row c_proj: (in, out) cut on in, stored (out, in)
]


def megatron_piece(full: torch.Tensor, dim: int, parts: int, rank: int, fused: int, transposed: bool) -> torch.Tensor:
    """Rank ``rank``'s piece as Megatron-style layers cut it, written with torch.chunk alone: each of the ``fused``
    projections packed along ``dim`` cut into ``parts`` equal chunks, the rank's chunks concatenated, the result
    stored transposed when the layer keeps (out, in)."""
    chunks = [projection.chunk(parts, dim)[rank] for projection in full.chunk(fused, dim)]
    piece = torch.cat(chunks, dim)
    return piece.t() if transposed else piece


@pytest.mark.parametrize("shape,split", SPLITS)
def test_pieces_are_the_layers_pieces_and_join_back_to_the_full_tensor(shape, split):
    """Each piece against an independent construction (torch.chunk, not the split's own offsets); then the join of
    those independently cut pieces gives the full tensor back."""
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)
    split.check(shape, "w")
    expected = [
        megatron_piece(full, split.dim, split.parts, r, split.fused, split.transposed) for r in range(split.parts)
    ]
    pieces = [split.piece(full, rank) for rank in range(split.parts)]
    assert all(torch.equal(p, e) for p, e in zip(pieces, expected))
    assert all(p.shape == split.piece_shape(shape) for p in pieces)
    assert split.full_shape(pieces[0].shape) == shape
    assert torch.equal(split.join(expected), full)


def test_gpt2_c_attn_pieces_hold_whole_heads_of_q_k_and_v():
    """Hand-computed: a (in=2, 3 x out=4) Conv1D weight whose q, k, v columns are 0-3, 4-7, 8-11; two ranks, stored
    transposed (out, in): rank 0 keeps q's columns 0-1, k's 4-5, v's 8-9."""
    full = torch.arange(12, dtype=torch.float32).repeat(2, 1)  # row i: [0, 1, ..., 11]
    piece = TensorSplit(1, 2, fused=3, transposed=True).piece(full, 0)
    assert piece.tolist() == [[c, c] for c in (0.0, 1.0, 4.0, 5.0, 8.0, 9.0)]


def test_fused_projections_are_cut_one_by_one():
    q, k, v = (torch.full((4, 2), float(i)) for i in range(3))
    fused = torch.cat([q, k, v], 1)  # (in=4, 3 x out=2) as Conv1D stores it
    piece = TensorSplit(1, 2, fused=3).piece(fused, 1)
    assert piece.tolist() == [[0.0, 1.0, 2.0]] * 4  # the second half of each projection


@pytest.mark.parametrize(
    "shape,split,message",
    [
        ((10, 4), TensorSplit(0, 4), "dim 0 of size 10 is not divisible by 4 ranks"),
        ((12, 4), TensorSplit(0, 2, fused=4), "in 4 fused parts is not divisible by 2 ranks"),
        ((12,), TensorSplit(1, 2), "has no dim 1"),
        ((2, 3, 4), TensorSplit(0, 2, transposed=True), "has no dim 0"),
    ],
)
def test_shapes_that_do_not_cut_evenly_are_named(shape, split, message):
    with pytest.raises(ValueError, match=message):
        split.check(shape, "w")


@pytest.mark.parametrize(
    "record",
    [
        {"dim": 0, "parts": 2, "fused": 1},
        {"dim": 0, "parts": 2, "fused": 1, "transposed": False, "extra": 1},
        {"dim": True, "parts": 2, "fused": 1, "transposed": False},
        {"dim": 0, "parts": "2", "fused": 1, "transposed": False},
        {"dim": 0, "parts": 0, "fused": 1, "transposed": False},
        {"dim": -1, "parts": 2, "fused": 1, "transposed": False},
        {"dim": 0, "parts": 2, "fused": 1, "transposed": 0},
        [0, 2, 1, False],
    ],
)
def test_an_edited_record_is_refused(record):
    with pytest.raises(ValueError):
        TensorSplit.from_record(record)


def test_a_record_round_trips():
    split = TensorSplit(1, 4, fused=3, transposed=True)
    assert TensorSplit.from_record(split.as_record()) == split
