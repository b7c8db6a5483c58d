"""The data adapter and the loss on one process (a one-rank group): labels shifted before the cut, the keys it
needs, plain values only, and a piece with no counted token contributing zero."""

import math

import pytest
import torch

from zeroshard.comm import Group
from zeroshard.sequence_parallel import UlyssesSPDataLoaderAdapter, shift_labels, token_weighted_loss

ONE = Group("sequence", (0,), None)


def _batch(tokens: int = 8, **extra) -> dict:
    ids = torch.arange(tokens)[None] + 10
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(tokens)[None], **extra}


def test_labels_are_shifted_before_the_cut_and_dropped():
    (piece,) = list(UlyssesSPDataLoaderAdapter([_batch(meta={"source": "a"})], 0, ONE, 1, "cpu"))
    assert "labels" not in piece and piece["meta"] == {"source": "a"}
    assert piece["shift_labels"].tolist() == [[11, 12, 13, 14, 15, 16, 17, -100]]
    assert torch.equal(shift_labels(torch.tensor([[1, 2, 3]])), torch.tensor([[2, 3, -100]]))


def test_every_epoch_starts_again_and_length_counts_pieces():
    adapter = UlyssesSPDataLoaderAdapter([_batch(), _batch()], 0, ONE, 1)
    assert len(adapter) == 2 and len(list(adapter)) == 2 and len(list(adapter)) == 2


@pytest.mark.parametrize(
    "batch,error,match",
    [
        ({"input_ids": torch.zeros(1, 8, dtype=torch.long)}, ValueError, r"no \['position_ids', 'labels'\]"),
        (_batch(mask=torch.ones(1, 7)), ValueError, "mask has shape \\[1, 7\\]"),
        (_batch(bad=object()), TypeError, "entry 'bad' is a object"),
        ([1, 2], TypeError, "batches must be dicts"),
    ],
)
def test_bad_batches_are_named(batch, error, match):
    with pytest.raises(error, match=match):
        next(UlyssesSPDataLoaderAdapter([batch], 0, ONE, 1))


def test_the_group_must_match_the_rank_and_size_given():
    with pytest.raises(ValueError, match="sp_rank 1 / sp_world_size 2 disagree"):
        UlyssesSPDataLoaderAdapter([], 1, ONE, 2)


def test_token_weighted_loss_of_a_piece_with_no_counted_token_is_zero_not_nan():
    loss = torch.tensor(2.5, requires_grad=True)
    assert token_weighted_loss(loss, torch.tensor([[1, 2, -100]]), ONE).item() == 2.5
    nan = torch.tensor(math.nan, requires_grad=True)
    weighted = token_weighted_loss(nan, torch.full((1, 4), -100), ONE)
    weighted.backward()
    assert weighted.item() == 0.0 and nan.grad.item() == 0.0
    with pytest.raises(ValueError, match="loss must be this rank's scalar mean"):
        token_weighted_loss(torch.ones(2), torch.ones(1, 2), ONE)
