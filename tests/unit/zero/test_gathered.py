"""``GatheredParameters``'s arguments, checked before anything is gathered (no process group: a world of one)."""

import pytest
import torch

from zeroshard.zero import GatheredParameters


@pytest.mark.parametrize("rank", [1, -1, "0", True, 0.0])
def test_a_modifier_rank_outside_the_world_is_refused_by_name(rank):
    param = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match=r"GatheredParameters\(modifier_rank=.*\): the rank whose values are kept"):
        GatheredParameters([param], modifier_rank=rank)


def test_whole_parameters_in_a_world_of_one_keep_their_values():
    param = torch.nn.Parameter(torch.ones(2))
    with GatheredParameters([param], modifier_rank=0):
        param.data.mul_(3)
    assert torch.equal(param.data, torch.full((2,), 3.0))
