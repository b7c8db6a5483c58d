"""The optimizer contract: each optimizer declares what it reads beyond its own elements, and what no layout can
give is refused from those needs alone (the same rule for a client's optimizer and one built by name)."""

import pytest
import torch

from zeroshard.optim import Lamb, Lion, MuonWithAuxAdam, OneBitAdam, OneBitLamb, ZeroOneAdam, bind_layout
from zeroshard.optim.contract import ELEMENTWISE, Needs, needs_of, refusal


def test_each_optimizer_declares_its_needs():
    assert needs_of(torch.optim.AdamW) == needs_of(Lion) == ELEMENTWISE
    assert needs_of(Lamb) == Needs(parameter_norms=True)
    assert needs_of(MuonWithAuxAdam) == Needs(whole_matrices=True)
    assert needs_of(torch.optim.Muon) == Needs(whole_matrices=True)  # torch's class, which cannot declare it
    assert needs_of(OneBitAdam).gradient_exchange == "momentum" and needs_of(OneBitAdam).elementwise
    assert needs_of(ZeroOneAdam) == Needs(gradient_exchange="optimizer_averaged")
    assert needs_of(OneBitLamb) == Needs(parameter_norms=True, gradient_exchange="optimizer_averaged")
    assert needs_of(OneBitLamb([torch.nn.Parameter(torch.zeros(2))])) == needs_of(OneBitLamb)  # instances too
    with pytest.raises(ValueError, match="unknown gradient_exchange 'two_bit'"):
        Needs(gradient_exchange="two_bit")


def test_refusals_follow_from_the_needs_alone():
    def why(needs, partitioned=False, axes=None, whole_shards=True):
        return refusal("X", needs, partitioned=partitioned, axes=axes or {}, whole_shards=whole_shards)

    averaged = Needs(gradient_exchange="optimizer_averaged")
    assert "X runs with zero_optimization.stage 0 only" in why(averaged, partitioned=True)
    assert why(averaged) is None  # stage 0, no split axis
    assert "tensor parallelism (tensor_parallel.autotp_size 2)" in why(averaged, axes={"tp": 2})
    momentum = Needs(gradient_exchange="momentum")
    assert why(momentum, partitioned=True, axes={"tp": 2}) is None  # 1-bit Adam: elementwise, exchanged by ZeRO
    assert "expert_parallel.autoep_size 2" in why(momentum, axes={"ep": 2})
    for needs in (Needs(parameter_norms=True), Needs(whole_matrices=True)):
        assert why(needs, partitioned=True, axes={"tp": 2, "ep": 2}) is None  # the layout completes both axes
        message = why(needs, partitioned=True, whole_shards=False)
        assert "device 'cpu', not 'nvme'" in message and "sub_group_size" in message
    assert why(ELEMENTWISE, partitioned=True, axes={"tp": 2, "ep": 2}, whole_shards=False) is None


def test_a_client_torch_muon_is_stepped_by_zeroshards_muon_over_the_same_groups():
    """A scheduler bound to the client's object keeps setting the learning rate the engine steps with."""
    matrix = torch.nn.Parameter(torch.randn(4, 6))
    client = torch.optim.Muon(
        [matrix], lr=0.05, momentum=0.9, nesterov=False, ns_steps=3, adjust_lr_fn="match_rms_adamw"
    )
    adopted = bind_layout(client, None)
    assert isinstance(adopted, MuonWithAuxAdam) and adopted.param_groups[0] is client.param_groups[0]
    group = adopted.param_groups[0]
    assert (group["ns_method"], group["ns_eps"], group["nesterov"], group["ns_steps"]) == ("standard", 1e-7, False, 3)
    client.param_groups[0]["lr"] = 0.01
    assert adopted.param_groups[0]["lr"] == 0.01


def test_zeroshards_muon_steps_as_torch_muon_with_its_settings():
    """nesterov off, other coefficients and steps, Moonshot's learning-rate adjustment: bit for bit."""
    torch.manual_seed(0)
    settings = dict(lr=0.05, momentum=0.9, weight_decay=0.1, nesterov=False, ns_steps=3, adjust_lr_fn="match_rms_adamw",
                    ns_coefficients=(3.0, -4.0, 2.0))  # fmt: skip
    ours, theirs = (torch.nn.Parameter(torch.randn(6, 4)) for _ in range(2))
    theirs.data.copy_(ours.data)
    reference = torch.optim.Muon([theirs], **settings)
    adopted = bind_layout(torch.optim.Muon([ours], **settings), None)
    for _ in range(3):
        grad = torch.randn(6, 4)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        adopted.step()
        reference.step()
    assert torch.equal(ours, theirs)


def test_a_layout_is_bound_once():
    lamb = Lamb([torch.nn.Parameter(torch.zeros(2))])
    first, second = object(), object()
    assert bind_layout(lamb, first) is lamb and lamb.layout is first
    bind_layout(lamb, first)  # the same layout again: nothing changes
    with pytest.raises(ValueError, match="already steps another ZeRO layout"):
        bind_layout(lamb, second)
