"""The reducer and the optimizer-state homes alone, on one process (a group of one issues no collective)."""

import torch

from zeroshard import comm
from zeroshard.offload import OffloadPlan
from zeroshard.partition import flat_layout
from zeroshard.zero import (
    DeviceState,
    FlatGroup,
    GradBucket,
    GradientReducer,
    HostState,
    ParamRecords,
    ReusableBuffers,
    build_optimizer_state,
)

ONE = comm.Group("world", (0,), None)
CPU = torch.device("cpu")


def _flat(params):
    layout = flat_layout([f"p{i}" for i in range(len(params))], [tuple(p.shape) for p in params], 1)
    return FlatGroup(layout, params, torch.float32, ONE, CPU, ParamRecords(), ReusableBuffers(CPU))


def _params():
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(5))]


def test_bucket_adds_repeated_contributions_and_zeroes_unused_slots():
    params = _params()
    bucket = GradBucket(_flat(params), torch.float32, torch.float32, ONE, CPU, ReusableBuffers(CPU))
    first = torch.ones(3, 2)
    bucket.stage_grad(0, first)
    assert not bucket.complete  # parameter 1 has brought nothing yet
    bucket.stage_grad(0, 2 * first)  # a reentrant recomputation's second contribution adds
    bucket.launch_reduce(predivide=1.0, async_op=False)
    bucket.finish_reduce(post_scale=0.5)
    assert torch.equal(bucket.grad[:6], torch.full((6,), 1.5)) and torch.equal(bucket.grad[6:], torch.zeros(5))
    assert bucket.expected == [2, None]  # learned: parameter 0 brings two contributions per backward


def test_reducer_hooks_collect_autograd_gradients():
    params = _params()
    flat = _flat(params)
    bucket = GradBucket(flat, torch.float32, torch.float32, ONE, CPU, ReusableBuffers(CPU))
    reducer = GradientReducer(
        [bucket], {p: f"p{i}" for i, p in enumerate(params)}, ONE, reduce_every_micro_step=True, overlap_comm=False
    )
    loss = (params[0].sum() * 2 + params[1].square().sum()).float()
    expected = torch.cat([torch.full((6,), 2.0), 2 * params[1].detach()])
    reducer.begin_backward(boundary=True, root=loss)
    loss.backward()
    reducer.end_backward()
    assert torch.allclose(bucket.grad, expected) and all(p.grad is None for p in params)
    reducer.destroy()
    (params[0].sum()).backward()  # hooks removed: gradients stay in param.grad
    assert params[0].grad is not None


def _adamw(groups, norms):
    return torch.optim.AdamW(groups, lr=0.1)


def test_device_state_steps_the_shard_in_place_and_host_state_in_sub_groups():
    grads = [torch.linspace(-1, 1, 11)]
    reference = torch.nn.Parameter(torch.cat([p.detach().reshape(-1) for p in _params()]))
    reference.grad = grads[0].clone()
    torch.optim.AdamW([reference], lr=0.1).step()

    params = _params()
    flat = _flat(params)
    device = DeviceState([flat], [0], [{"params": params}], _adamw, torch.float32)
    assert device.subgroups[0].param.data_ptr() == flat.shard.data_ptr()  # fp32: the master is the shard
    device.step([g.clone() for g in grads])
    assert torch.allclose(flat.shard, reference.detach())

    params = _params()
    flat = _flat(params)
    host = HostState([flat], [0], [{"params": params}], _adamw, torch.float32, sub_group_size=4, pin_memory=False)
    assert [(s.start, s.stop) for s in host.subgroups] == [(0, 4), (4, 8), (8, 11)]
    host.step([g.clone() for g in grads])
    assert torch.allclose(flat.shard, reference.detach()) and torch.allclose(params[1], reference[6:])
    saved = host.read_flat(0)
    assert sorted(saved) == ["exp_avg", "exp_avg_sq", "master"] and torch.allclose(saved["master"], reference)
    host.write_flat(0, {k: torch.zeros_like(v) for k, v in saved.items()}, host.scalars(0))
    host.publish()
    assert torch.equal(flat.shard, torch.zeros(11)) and host.bytes_held()["master"] == {"host": 44}


def test_the_offload_plan_chooses_the_home():
    def build(plan):
        params = _params()
        return build_optimizer_state([_flat(params)], [0], [{"params": params}], _adamw, torch.float32, plan, None)

    host = build(OffloadPlan(optimizer_device="cpu", sub_group_size=4))
    assert isinstance(host, HostState) and host.location == "host" and len(host.subgroups) == 3
    device = build(OffloadPlan())
    assert type(device) is DeviceState and device.location == "device" and len(device.subgroups) == 1
