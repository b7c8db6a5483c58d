"""zeroshard.zero.reset_parameters: what a zero.Init build replays after construction, applied to a normally built
model (zero.Init itself joins a process group: its tests are in tests/distributed/test_zero_init.py)."""

import torch
import torch.nn as nn


def test_hugging_face_models_get_their_own_initialization():
    from transformers import GPT2Config, GPT2LMHeadModel

    from zeroshard.zero import reset_parameters

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=64, n_positions=8))
    reset_parameters(model, seed=5)  # the model's _init_weights, seeded per module path
    weight = model.transformer.h[0].attn.c_attn.weight
    assert torch.isfinite(weight).all() and abs(weight.std().item() - 0.02) < 0.003


def test_without_an_init_function_construction_values_stay():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    from zeroshard.zero import reset_parameters

    reset_parameters(model, seed=1)
    assert all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())
    reset_parameters(model, seed=1, param_init_fn=lambda m: nn.init.ones_(m.weight) if isinstance(m, nn.Linear) else 0)
    assert torch.equal(model[0].weight.detach(), torch.ones(3, 3)) and torch.equal(model[0].bias, before["0.bias"])
