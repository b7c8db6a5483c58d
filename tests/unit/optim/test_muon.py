"""Muon with its AdamW half: on whole tensors the same step as torch.optim.Muon + torch.optim.AdamW, bit for bit;
DeepSpeed's selection rule; muon_lr / adam_lr reach their halves; what is not implemented is refused by name."""

import copy

import pytest
import torch

from zeroshard.optim import MuonWithAuxAdam, build_optimizer, muon_param_groups
from zeroshard.optim.muon import uses_muon


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(10, 6)
        self.proj = torch.nn.Linear(6, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.lm_head = torch.nn.Linear(8, 10, bias=False)

    def forward(self, x):
        return self.lm_head(self.norm(self.proj(self.embed_tokens(x))))


SETTINGS = {"lr": 1e-3, "momentum": 0.9, "weight_decay": 0.1, "muon_lr": 2e-2, "adam_lr": 3e-3, "ns_method": "standard"}


def test_selection_rule_is_deepspeeds_matrices_outside_embeddings_and_head():
    net = Net()
    assert [n for n, p in net.named_parameters() if uses_muon(n, p)] == ["proj.weight"]


def test_each_half_gets_its_settings_and_the_groups_own_win():
    net = Net()
    decay = [net.proj.weight, net.lm_head.weight]
    groups = [{"params": decay}, {"params": [p for p in net.parameters() if all(p is not q for q in decay)],
                                  "weight_decay": 0.0}]  # fmt: skip
    split = muon_param_groups(net.named_parameters(), groups, SETTINGS)
    summary = [(g["use_muon"], g["lr"], g["weight_decay"], len(g["params"])) for g in split]
    assert summary == [(True, 2e-2, 0.1, 1), (False, 3e-3, 0.1, 1), (False, 3e-3, 0.0, 4)]
    assert "betas" not in split[0] and "momentum" not in split[1]


def test_whole_tensor_steps_equal_torch_muon_and_adamw_bit_for_bit():
    torch.manual_seed(0)
    net = Net()
    ref = copy.deepcopy(net)
    ours = MuonWithAuxAdam(muon_param_groups(net.named_parameters(), [{"params": list(net.parameters())}], SETTINGS))
    muon = [p for n, p in ref.named_parameters() if uses_muon(n, p)]
    adam = [p for n, p in ref.named_parameters() if not uses_muon(n, p)]
    theirs = [
        torch.optim.Muon(muon, lr=2e-2, momentum=0.9, weight_decay=0.1),
        torch.optim.AdamW(adam, lr=3e-3, weight_decay=0.1),
    ]
    for _ in range(3):
        x = torch.randint(0, 10, (4, 5))
        for model, optimizers in ((net, [ours]), (ref, theirs)):
            for o in optimizers:
                o.zero_grad()
            model(x).pow(2).mean().backward()
            for o in optimizers:
                o.step()
    for a, b in zip(net.parameters(), ref.parameters()):
        assert torch.equal(a, b)


def one_matrix() -> list[dict]:  # fresh each time: an optimizer fills its defaults into the dicts it is given
    return [{"params": [torch.nn.Parameter(torch.zeros(4, 4))], "use_muon": True}]


def test_config_refusals_are_named():
    with pytest.raises(ValueError, match="unknown config key 'optimizer.params.per_head_muon'"):
        build_optimizer("Muon", {"per_head_muon": True}, one_matrix(), zero_stage=0, allow_untested=False)
    with pytest.raises(ValueError, match="ns_method 'cubic': expected one of \\['gram', 'standard'\\]"):
        MuonWithAuxAdam(one_matrix(), ns_method="cubic")
    built = build_optimizer("Muon", {}, one_matrix(), zero_stage=0, allow_untested=False)  # DeepSpeed's: Gram
    assert built.param_groups[0]["ns_method"] == "gram"


@pytest.mark.parametrize(
    "params,field",
    [
        ({"muon_lr": float("nan")}, "optimizer.params.muon_lr"),
        ({"adam_lr": float("nan")}, "optimizer.params.adam_lr"),
        ({"muon_lr": -0.1}, "optimizer.params.muon_lr"),
        ({"adam_lr": float("inf")}, "optimizer.params.adam_lr"),
        ({"momentum": 1.5}, "optimizer.params.momentum 1.5"),
        ({"momentum": 1.0}, "optimizer.params.momentum 1.0"),
    ],
)
def test_learning_rates_and_momentum_that_would_poison_the_weights_are_refused(params, field):
    """Accepted before: a NaN muon_lr / adam_lr turned the weights NaN, momentum 1.5 diverged."""
    with pytest.raises(ValueError, match=field):
        build_optimizer("Muon", params, one_matrix(), zero_stage=0, allow_untested=False)


@pytest.mark.parametrize("shape", [(8, 40), (40, 8), (12, 12), (3, 50)])
def test_gram_newton_schulz_is_the_quintic_iteration_on_the_gram_matrix(shape):
    """DeepSpeed's ns_method "gram" computes the same polynomial of X X^T as the plain iteration: in fp32 (on the
    CPU, as DeepSpeed's CPU accelerator runs it) the two agree to rounding, wide or tall, and a square matrix takes
    the plain path."""
    from zeroshard.optim.muon import gram_newton_schulz

    g = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
    x = g.T if shape[0] > shape[1] else g
    x = x / x.norm()
    a, b, c = 3.4445, -4.7750, 2.0315
    for _ in range(5):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    plain = x.T if shape[0] > shape[1] else x
    got = gram_newton_schulz(g)
    assert got.dtype == torch.float32 and got.shape == g.shape
    assert ((got - plain).norm() / plain.norm()).item() <= 1e-5
