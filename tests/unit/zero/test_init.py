"""zero.Init before initialize: writes to parameters with no data are errors, writes inside a gather are kept."""

import pytest
import torch
import torch.nn as nn

from zeroshard.compat.deepspeed.zero import ZeroParamStatus
from zeroshard.zero import GatheredParameters, Init, ShardedParameterError


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


class NoReset(nn.Module):
    """A module whose parameter only its own __init__ initializes (like HF's Conv1D)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 3))


def test_a_module_nothing_can_initialize_is_refused_by_name():
    from zeroshard.zero import reset_parameters

    with pytest.raises(ValueError, match=r"module '1' \(NoReset\) has parameters but no reset_parameters"):
        reset_parameters(nn.Sequential(nn.Linear(3, 3), NoReset()), seed=1)
    with Init(seed=1):
        model = nn.Sequential(nn.Linear(3, 3), NoReset())
    with GatheredParameters([model[1].weight], modifier_rank=0):  # a load writes it: it starts at zero
        assert torch.equal(model[1].weight.detach(), torch.zeros(3, 3))
    with Init(seed=1, param_init_fn=lambda m: nn.init.ones_(m.weight) if isinstance(m, NoReset) else None):
        model = nn.Sequential(nn.Linear(3, 3), NoReset())
    with GatheredParameters([model[1].weight]):
        assert torch.equal(model[1].weight.detach(), torch.ones(3, 3))


def test_hugging_face_models_get_their_own_initialization():
    from transformers import GPT2Config, GPT2LMHeadModel

    from zeroshard.zero import reset_parameters

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=64, n_positions=8))
    reset_parameters(model, seed=5)  # Conv1D has no reset_parameters: the model's _init_weights gives the values
    weight = model.transformer.h[0].attn.c_attn.weight
    assert torch.isfinite(weight).all() and abs(weight.std().item() - 0.02) < 0.003
