"""What a tensor-parallel rank sends between stages under ``pipeline.pipe_partitioned``: its slice of the flattened
tensor, the last one padded with zeros; the slices in rank order are the tensor."""

import pytest
import torch

from zeroshard.comm import Group
from zeroshard.pipe.exchange import _slice


@pytest.mark.parametrize("numel, ranks", [(7, 2), (8, 2), (5, 4), (1, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8, torch.int64])
def test_slices_in_rank_order_are_the_tensor_zero_padded(numel, ranks, dtype):
    tensor = (torch.arange(numel) + 1).to(dtype).view(-1, 1)
    # this process (rank 0) at position r of the group: the slice of tensor-parallel rank r
    pieces = [_slice(tensor, Group("tensor", tuple((i - r) % ranks for i in range(ranks)), None)) for r in range(ranks)]
    per = -(-numel // ranks)
    assert all(piece.numel() == per and piece.dtype == dtype for piece in pieces)
    joined = torch.cat(pieces)
    assert torch.equal(joined[:numel], tensor.reshape(-1)) and not joined[numel:].any()
