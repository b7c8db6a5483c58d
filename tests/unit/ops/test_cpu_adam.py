import pytest
import torch

from zeroshard.ops.adam import CPUAdam, DeepSpeedCPUAdam
from zeroshard.optim import check_client_optimizer


@pytest.mark.parametrize("adamw_mode,reference", [(True, torch.optim.AdamW), (False, torch.optim.Adam)])
def test_matches_torch_adam(adamw_mode, reference):
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(257)) for _ in range(3)]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    a = CPUAdam(ours, lr=1e-2, weight_decay=0.1, adamw_mode=adamw_mode)
    b = reference(theirs, lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        a.step()
        b.step()
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)


def test_deepspeed_name_and_zero_compatibility():
    assert DeepSpeedCPUAdam is CPUAdam
    opt = DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(2))])
    check_client_optimizer(opt, zero_stage=3, allow_untested=False)  # elementwise: safe on shards
    with pytest.raises(NotImplementedError, match="bias_correction"):
        CPUAdam([torch.nn.Parameter(torch.zeros(2))], bias_correction=False)
