"""Routing arithmetic, and the expert-parallel module on a group of one rank against transformers' own fused
experts (the distributed cases are in tests/distributed/test_moe.py)."""

import pytest
import torch

from zeroshard import comm
from zeroshard.moe import ExpertParallelExperts, TokenRoute, find_fused_experts, regroup_by_expert, shard_experts
from zeroshard.testing.hf import tiny_causal_lm


def test_rows_are_sorted_by_expert_in_token_order_and_counted_per_rank():
    top_k = torch.tensor([[2, 0], [1, 2], [3, 0]])  # 3 tokens, k = 2, 4 experts
    route = TokenRoute.of(top_k, 4)
    assert route.counts.tolist() == [2, 1, 2, 1]
    assert route.order.tolist() == [1, 5, 2, 0, 3, 4]  # expert 0: (t0, c1), (t2, c1); expert 1: (t1, c0); ...
    assert route.tokens.tolist() == [0, 2, 1, 0, 1, 2]
    assert route.per_rank(2) == [3, 3] and route.per_rank(4) == [2, 1, 2, 1]


def test_rows_received_source_major_are_regrouped_expert_major():
    received = torch.tensor([[1, 0], [2, 1]])  # from rank 0: 1 row for local expert 0; from rank 1: 2 and 1
    order, per_expert = regroup_by_expert(received)
    assert per_expert == [3, 1]
    assert order.tolist() == [0, 1, 2, 3]  # rows: r0e0, r1e0, r1e0, r1e1 are already expert-major
    order, per_expert = regroup_by_expert(torch.tensor([[1, 1], [1, 0]]))  # rows: r0e0, r0e1, r1e0
    assert order.tolist() == [0, 2, 1] and per_expert == [2, 1]


@pytest.mark.parametrize("bad", [torch.tensor([[4, 0]]), torch.tensor([[-1, 0]]), torch.tensor([0, 1])])
def test_routes_outside_the_experts_are_refused(bad):
    with pytest.raises(ValueError, match="expert indices must lie in|top_k_index must be"):
        TokenRoute.of(bad, 4)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_one_rank_expert_module_equals_transformers_experts(family):
    """With every expert local the exchange is the identity: outputs and gradients equal the model's own module's."""
    model = tiny_causal_lm(family, num_experts_per_tok=2)
    (path, experts), *_ = find_fused_experts(model, preset=family)
    alone = comm.Group("expert", (comm.get_rank(),), None)
    mine = ExpertParallelExperts(experts, alone)
    hidden = torch.randn(10, model.config.hidden_size, requires_grad=True)
    top_k = torch.stack([torch.randperm(mine.num_experts)[:2] for _ in range(10)])
    weights = torch.rand(10, 2)
    expected, actual = experts(hidden, top_k, weights), mine(hidden, top_k, weights)
    assert torch.allclose(actual, expected, rtol=1e-6, atol=1e-7)
    expected_grads = torch.autograd.grad(expected.square().sum(), [hidden, experts.gate_up_proj, experts.down_proj])
    actual_grads = torch.autograd.grad(actual.square().sum(), [hidden, mine.gate_up_proj, mine.down_proj])
    for a, e in zip(actual_grads, expected_grads):
        assert torch.allclose(a, e, rtol=1e-5, atol=1e-7)


def test_sharding_keeps_parameter_names_and_refuses_what_it_cannot_split():
    model = tiny_causal_lm("mixtral")
    names = [n for n, _ in model.named_parameters()]
    alone = comm.Group("expert", (comm.get_rank(),), None)
    pieces = shard_experts(model, alone, preset="mixtral")
    assert [n for n, _ in model.named_parameters()] == names
    assert len(pieces) == 4 and {(s.axis, s.dim, s.parts) for s in pieces.values()} == {("ep", 0, 1)}
    with pytest.raises(ValueError, match="preset_model 'qwen3_moe' is for model types"):
        find_fused_experts(tiny_causal_lm("mixtral"), preset="qwen3_moe")
    with pytest.raises(NotImplementedError, match="'deepseek_v3' is not implemented"):
        find_fused_experts(tiny_causal_lm("mixtral"), preset="deepseek_v3")
    with pytest.raises(ValueError, match="no fused experts module"):
        shard_experts(tiny_causal_lm("llama"), alone)
    split_by_transformers = tiny_causal_lm("mixtral")
    split_by_transformers.model.layers[0].mlp.experts._is_expert_parallel = True
    with pytest.raises(NotImplementedError, match="already split over an expert-parallel group by transformers"):
        shard_experts(split_by_transformers, alone)
