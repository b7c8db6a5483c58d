"""Planning packed quantized weights (bitsandbytes' real ``Params4bit``): a flat group of their own per unit, in their
storage dtype; a trainable one is refused by name."""

import pytest
import torch
import torch.nn as nn

from zeroshard.config import parse_config
from zeroshard.zero.planning import is_packed, plan_model

bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (pip install bitsandbytes)")


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(64)
        self.proj = bnb.nn.Linear4bit(64, 64, bias=False, compute_dtype=torch.bfloat16, quant_storage=torch.bfloat16)
        self.adapter = nn.Linear(64, 64, bias=False)

    def forward(self, x):
        return self.adapter(self.proj(self.norm(x)))


def _model():
    model = nn.Sequential(Layer(), Layer()).to("cpu")  # bitsandbytes quantizes on the move
    for layer in model:
        layer.norm.requires_grad_(False)
    return model


def test_packed_weights_get_groups_of_their_own_in_their_storage_dtype():
    model = _model()
    assert is_packed(model[0].proj.weight) and not is_packed(model[0].norm.weight)
    block = {"stage": 3, "gather_unit_classes": ["Layer"], "stage3_param_persistence_threshold": 0}
    zero = parse_config({"zero_optimization": block}).zero_optimization
    trainable = [p for p in model.parameters() if p.requires_grad]
    plan = plan_model(model, [{"params": trainable}], zero, shard_count=2)
    groups = [(len(g.params), g.dtype, all(is_packed(p) for p in g.params)) for g in plan.frozen]
    # per layer: the frozen norm in the compute dtype, the 4-bit weight in bf16 storage
    assert groups == [(2, None, False), (1, torch.bfloat16, True)] * 2


def test_a_trainable_packed_weight_is_refused_by_name():
    model = _model()
    model[1].proj.weight.requires_grad_(True)
    zero = parse_config({"zero_optimization": {"stage": 3}}).zero_optimization
    with pytest.raises(ValueError, match=r"parameter '1\.proj\.weight' is packed quantized storage"):
        plan_model(model, [{"params": [p for p in model.parameters() if p.requires_grad]}], zero, shard_count=2)
