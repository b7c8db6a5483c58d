"""The expert-parameter protocol's tags as initialize reads them (DeepSpeed's ``allreduce = False`` and
``group_name``), refused by name when they do not describe stacks of experts of one expert-parallel size, and
transformers' own expert split refused (the distributed cases are in tests/distributed/test_moe.py)."""

import pytest
import torch

from zeroshard.config import parse_config
from zeroshard.moe import tagged_experts
from zeroshard.runtime.parallelize import expert_parallel_size, refuse_experts_split_by_transformers


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.router = torch.nn.Linear(4, 4)
        self.gate_up = torch.nn.Parameter(torch.zeros(2, 4, 8))
        self.down = torch.nn.Parameter(torch.zeros(2, 4, 4))


def tag(*params, group="ep_size_2"):
    for param in params:
        param.allreduce, param.group_name = False, group


def settings(block: dict):
    return parse_config({"expert_parallel": block}).expert_parallel


def test_tagged_stacks_of_experts_give_the_expert_parallel_size():
    block = Block()
    assert tagged_experts(block) == {} and expert_parallel_size(block, settings({})) == 1
    tag(block.gate_up, block.down)
    assert set(tagged_experts(block)) == {block.gate_up, block.down}
    assert expert_parallel_size(block, settings({})) == 2
    block.router.weight.allreduce = True  # an explicit True is a dense parameter
    assert len(tagged_experts(block)) == 2


@pytest.mark.parametrize("group", [None, "ep_size_0", "ep2", "ep_size_2; rm -rf /", 2, "ep_size_"])
def test_a_tag_without_a_deepspeed_group_name_is_refused_naming_the_parameter(group):
    block = Block()
    tag(block.gate_up, group=group)
    with pytest.raises(NotImplementedError, match="parameter 'gate_up' is tagged allreduce=False"):
        tagged_experts(block)


def test_tags_that_are_not_stacks_or_mix_sizes_are_refused():
    block = Block()
    tag(block.router.weight)
    with pytest.raises(NotImplementedError, match="'router.weight' .* is not a stack of experts"):
        tagged_experts(block)
    block = Block()
    tag(block.gate_up)
    tag(block.down, group="ep_size_4")
    with pytest.raises(NotImplementedError, match="several expert-parallel sizes"):
        expert_parallel_size(block, settings({}))


def test_tags_and_the_autoep_block_together_are_refused():
    block = Block()
    tag(block.gate_up, block.down)
    with pytest.raises(ValueError, match="remove the expert_parallel block"):
        expert_parallel_size(block, settings({"enabled": True, "autoep_size": 2}))
    assert expert_parallel_size(Block(), settings({"enabled": True, "autoep_size": 4})) == 4


def test_experts_transformers_split_are_refused_before_anything_happens():
    block = Block()
    refuse_experts_split_by_transformers(block)
    block.router._is_expert_parallel = True
    with pytest.raises(NotImplementedError, match="router is already split over an expert-parallel group"):
        refuse_experts_split_by_transformers(block)
