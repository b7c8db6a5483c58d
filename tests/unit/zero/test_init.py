"""zero.Init before initialize: writes to parameters with no data are errors, writes inside a gather are kept."""

import pytest
import torch
import torch.nn as nn

from zeroshard.zero import GatheredParameters, Init, ShardedParameterError
from zeroshard.zero.sharded_param import ZeroParamStatus


def _model():
    with Init(seed=3):
        return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_write_outside_a_gather_raises_naming_the_parameter():
    model = _model()
    with pytest.raises(ShardedParameterError, match=r"'Linear\.weight' \(8, 4\) was built under zero.Init"):
        with torch.no_grad():
            model[0].weight.copy_(torch.ones(8, 4))
    with pytest.raises(ShardedParameterError):
        model[2].bias.data.fill_(1.0)  # .data is an alias of nothing: refused too, never a silent no-op


def test_shape_and_state_dict_keys_stay_answerable():
    model = _model()
    assert model[0].weight.shape == (8, 4) and model[0].weight.numel() == 32
    assert list(model.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]  # HF lists keys this way
    assert model[0].weight.ds_shape == (8, 4) and model[0].weight.ds_numel == 32
    assert model[0].weight.ds_status is ZeroParamStatus.NOT_AVAILABLE


def test_write_inside_a_gather_with_modifier_is_kept_and_others_keep_initial_values():
    model = _model()
    with GatheredParameters([model[0].weight], modifier_rank=0):
        with torch.no_grad():
            model[0].weight.copy_(torch.arange(32.0).view(8, 4))
    assert torch.equal(model[0].weight.detach(), torch.arange(32.0).view(8, 4))
    # the module's other parameter got its initial value with it (reset_parameters under the Init seed)
    bias = model[0].bias.detach()
    assert not bias.is_meta and bias.abs().sum() > 0
    assert model[2].weight.is_meta  # untouched modules still wait for initialize


def test_gather_order_is_creation_order_not_argument_order():
    """Hugging Face passes a set; every rank must broadcast in one order."""
    model = _model()
    params = [model[2].bias, model[0].weight, model[2].weight]
    gathered = GatheredParameters(set(params))
    assert gathered.params == [model[0].weight, model[2].weight, model[2].bias]
