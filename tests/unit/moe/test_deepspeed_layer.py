"""zeroshard's ``MoE`` against DeepSpeed 0.19.8's own layer (``tests/fixtures/deepspeed_moe``, written by DeepSpeed):
the same outputs, ``l_aux``, ``exp_counts`` and gradients per micro-batch, capacity drops included, in one process.
The expert-parallel cases are in tests/distributed/test_moe.py."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from zeroshard.moe import MoE, top1, top2
from zeroshard.testing.fixtures import module_from_file

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "deepspeed_moe"


SHAPES = module_from_file(FIXTURES / "shapes.py", "ds_moe_shapes")
EXPECTED = load_file(str(FIXTURES / "expected.safetensors"))


def weights_of(case: str) -> dict:
    prefix = f"{case}.weight."
    return {k.removeprefix(prefix): v for k, v in EXPECTED.items() if k.startswith(prefix)}


@pytest.mark.parametrize("case", sorted(SHAPES.CASES))
def test_the_layer_computes_what_deepspeeds_computes(case):
    layer = SHAPES.build(MoE, case)
    layer.load_state_dict(weights_of(case))
    layer.train()
    x, target = EXPECTED["x"], EXPECTED["target"]
    assert {n for n, _ in layer.named_parameters()} == set(weights_of(case))  # DeepSpeed's parameter names
    for b in range(SHAPES.MICRO_BATCHES):
        layer.zero_grad(set_to_none=True)
        out, l_aux, counts = layer(x[b])
        SHAPES.loss(out, l_aux, target[b]).backward()
        torch.testing.assert_close(out, EXPECTED[f"{case}.{b}.out"], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(l_aux.reshape(1), EXPECTED[f"{case}.{b}.l_aux"], rtol=1e-6, atol=0)
        assert counts.tolist() == EXPECTED[f"{case}.{b}.counts"].tolist()
        for name, p in layer.named_parameters():
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            torch.testing.assert_close(grad, EXPECTED[f"{case}.{b}.grad.{name}"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["top2_cf1_drop", "top1_cf1_drop"])
def test_the_drop_cases_drop_choices(case):
    """The premise of the capacity cases: some choices do not fit (so the comparison covers dropping)."""
    layer = SHAPES.build(MoE, case)
    layer.load_state_dict(weights_of(case))
    logits = EXPECTED["x"][0].reshape(-1, SHAPES.HIDDEN) @ layer.deepspeed_moe.gate.wg.weight.t()
    options = SHAPES.CASES[case]
    if options["k"] == 2:
        gated = top2(logits, options["capacity_factor"], 4, True, second_expert_sampling=False)
    else:
        gated = top1(logits, options["capacity_factor"], 4, use_rts=False)
    assert (~gated.kept).sum() > 0


def test_bad_layer_arguments_are_refused_by_name():
    expert = torch.nn.Linear(4, 4)
    for kwargs, message in [
        (dict(num_experts=3, ep_size=2), "divisible by ep_size"),
        (dict(num_experts=4, k=3), "k=3"),
        (dict(num_experts=4, noisy_gate_policy="Gauss"), "noisy_gate_policy"),
        (dict(num_experts=4, enable_expert_tensor_parallelism=True), "enable_expert_tensor_parallelism"),
        (dict(num_experts=4, capacity_factor=float("nan")), "capacity_factor"),
        (dict(num_experts=0), "num_experts"),
        (dict(num_experts=True), "num_experts"),
    ]:
        with pytest.raises((ValueError, NotImplementedError), match=message):
            MoE(4, expert, **kwargs)
    layer = MoE(4, expert, num_experts=4, ep_size=2)
    with pytest.raises(RuntimeError, match="build the engine first"):
        layer(torch.randn(2, 4))
    with pytest.raises(ValueError, match="at least min_capacity tokens"):
        MoE(4, expert, num_experts=4, k=1, min_capacity=8)(torch.randn(3, 4))
