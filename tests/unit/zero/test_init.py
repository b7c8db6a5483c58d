"""zeroshard.zero.reset_parameters: what a zero.Init build replays after construction, applied to a normally built
model; zero.Init's arguments as it checks them when constructed (entering it joins a process group: those tests are
in tests/distributed/test_zero_init.py)."""

import pytest
import torch
import torch.nn as nn

from zeroshard.zero import Init


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


NVME_CONFIG = {
    "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/tmp"}},
}


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"remote_device": "gpu"}, "expected None, 'none', 'cpu' or 'nvme'"),
        ({"remote_device": "nvme"}, "needs config_dict_or_path with zero_optimization.offload_param"),
        (
            {"remote_device": "nvme", "config_dict_or_path": {"zero_optimization": {"stage": 3}}},
            "needs config_dict_or_path",
        ),
        ({"remote_device": 3}, "expected None"),
    ],
)
def test_init_remote_device_is_checked_as_deepspeed_does(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Init(**kwargs)


def test_init_remote_device_nvme_with_the_config_bounds_the_heap():
    """DeepSpeed's Megatron example: remote_device='nvme' with the config naming the NVMe path. Nothing is placed
    before initialize (values are put away either way); the host heap is bounded from construction on."""
    assert Init(remote_device="nvme", config_dict_or_path=NVME_CONFIG, pin_memory=True).bounds_heap
    assert Init(config_dict_or_path=NVME_CONFIG).bounds_heap
    assert not Init(remote_device="cpu").bounds_heap
    cpu_config = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
    assert not Init(remote_device="nvme", config_dict_or_path=cpu_config).bounds_heap  # the config wins
