"""The gradient exchange is the one the optimizer declares: exact unless a 1-bit optimizer says otherwise; the
compressed ones refuse the layouts they cannot compress (hybrid replicas; 0/1 Adam and 1-bit LAMB above stage 0 are
refused by the optimizer contract, tests/unit/optim/test_contract.py)."""

from types import SimpleNamespace

import pytest
import torch

from zeroshard.optim import OneBitAdam, OneBitLamb, ZeroOneAdam
from zeroshard.zero.exchange import (
    ExactExchange,
    MomentumExchange,
    OptimizerAveragedExchange,
    exchange_for,
)


def _params():
    return [torch.nn.Parameter(torch.zeros(4))]


def _reducer(replicas: int = 1):
    return SimpleNamespace(buckets=[SimpleNamespace(replica_group=SimpleNamespace(size=replicas))])


def test_each_optimizer_names_its_exchange():
    assert type(exchange_for(torch.optim.AdamW(_params()), [], _reducer(), [])) is ExactExchange
    assert type(exchange_for(OneBitAdam(_params()), [], _reducer(), [])) is MomentumExchange
    for cls in (ZeroOneAdam, OneBitLamb):
        assert type(exchange_for(cls(_params()), [], _reducer(), [])) is OptimizerAveragedExchange


def test_hybrid_replicas_are_refused_by_name():
    with pytest.raises(NotImplementedError, match="OneBitAdam with hybrid sharding"):
        exchange_for(OneBitAdam(_params()), [], _reducer(replicas=2), [])


def test_the_exact_exchange_holds_nothing_and_changes_no_gradient():
    exchange = exchange_for(torch.optim.AdamW(_params()), [], _reducer(), [])
    grads = [torch.ones(3)]
    assert exchange.transform(grads, 0.5, lambda index: None) == (grads, 0.5)
    assert exchange.nbytes() == 0 and exchange.state_tensors() == {} and not exchange.load_state_tensors({})
