"""The reducer and the optimizer-state homes alone, on one process (a group of one issues no collective)."""

import pytest
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
from zeroshard.zero.grad_home import ResidentGrad

ONE = comm.Group("world", (0,), None)
CPU = torch.device("cpu")


def _flat(params, resident=True, prefix="p"):
    """A flat group of ``params`` on this one process (``resident``: whole, as at stages 0-2; else sharded)."""
    layout = flat_layout([f"{prefix}{i}" for i in range(len(params))], [tuple(p.shape) for p in params], 1)
    return FlatGroup(
        layout=layout,
        params=params,
        compute_dtype=torch.float32,
        shard_group=ONE,
        device=CPU,
        records=ParamRecords(),
        buffers=ReusableBuffers(CPU),
        resident=resident,
    )


def _home(flat):
    return ResidentGrad.zeros(flat.layout.shard_numel, torch.float32, CPU, pin=False, location="device")


def _params():
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(5))]


@pytest.mark.parametrize("next_to_reduce", [True, False], ids=["staged", "parked"])
def test_bucket_adds_repeated_contributions_and_zeroes_unused_slots(next_to_reduce):
    params = _params()
    flat = _flat(params)
    bucket = GradBucket(
        flat=flat,
        reduce_dtype=torch.float32,
        home=_home(flat),
        replica_group=ONE,
        buffers=ReusableBuffers(CPU),
    )
    first = torch.ones(3, 2)
    bucket.stage_grad(0, first, next_to_reduce)
    assert not bucket.complete  # parameter 1 has brought nothing yet
    bucket.stage_grad(0, 2 * first, next_to_reduce)  # a reentrant recomputation's second contribution adds
    bucket.launch_reduce(predivide=1.0, async_op=False)
    bucket.finish_reduce(post_scale=0.5, final=True)
    assert torch.equal(bucket.grad[:6], torch.full((6,), 1.5)) and torch.equal(bucket.grad[6:], torch.zeros(5))
    assert bucket.expected == [2, None]  # learned: parameter 0 brings two contributions per backward
    assert torch.equal(first, torch.ones(3, 2))  # a parked gradient is never added to in place


def test_a_parked_bucket_draws_its_staging_buffer_at_launch():
    params = _params()
    buffers = ReusableBuffers(CPU)
    flat = _flat(params)
    bucket = GradBucket(
        flat=flat,
        reduce_dtype=torch.float32,
        home=_home(flat),
        replica_group=ONE,
        buffers=buffers,
    )
    grad0, grad1 = torch.ones(3, 2), torch.full((5,), 3.0)
    bucket.stage_grad(0, grad0, next_to_reduce=False)
    assert buffers.in_use_bytes == 0 and bucket.staging_bytes() == grad0.numel() * 4  # autograd's tensor, held
    bucket.stage_grad(1, grad1, next_to_reduce=True)  # its turn came, but it parked before: it parks on
    assert buffers.in_use_bytes == 0
    idle = buffers.acquire(bucket.layout.padded_numel, torch.float32)  # e.g. the unit's gathered buffer, freed
    buffers.release(idle)
    bucket.launch_reduce(predivide=1.0, async_op=False)
    assert buffers.idle_bytes == 0  # the launch reused the freed buffer
    bucket.finish_reduce(post_scale=1.0, final=True)
    assert torch.equal(bucket.grad, torch.cat([grad0.reshape(-1), grad1]))
    assert bucket.staging_bytes() == 0


def test_reducer_hooks_collect_autograd_gradients():
    params = _params()
    flat = _flat(params)
    bucket = GradBucket(
        flat=flat,
        reduce_dtype=torch.float32,
        home=_home(flat),
        replica_group=ONE,
        buffers=ReusableBuffers(CPU),
    )
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
    device.step([ResidentGrad(g.clone(), "device") for g in grads])
    assert torch.allclose(flat.shard, reference.detach())

    params = _params()
    flat = _flat(params)
    host = HostState([flat], [0], [{"params": params}], _adamw, torch.float32, sub_group_size=4, pin_memory=False)
    assert [(s.start, s.stop) for s in host.subgroups] == [(0, 4), (4, 8), (8, 11)]
    host.step([ResidentGrad(g.clone(), "host") for g in grads])
    assert torch.allclose(flat.shard, reference.detach()) and torch.allclose(params[1], reference[6:])
    saved = host.read_flat(0)
    assert sorted(saved) == ["exp_avg", "exp_avg_sq", "master"] and torch.allclose(saved["master"], reference)
    host.write_flat(0, {k: torch.zeros_like(v) for k, v in saved.items()}, host.scalars(0))
    host.publish()
    assert torch.equal(flat.shard, torch.zeros(11)) and host.bytes_held()["master"] == {"host": 44}


def test_device_state_steps_16_bit_gradients_one_flat_group_at_a_time():
    torch.manual_seed(1)
    groups = [[torch.nn.Parameter(torch.randn(4, 3).bfloat16())], [torch.nn.Parameter(torch.randn(7).bfloat16())]]
    flats = [
        FlatGroup(
            layout=flat_layout(["w"], [tuple(g[0].shape)], 1),
            params=g,
            compute_dtype=torch.bfloat16,
            shard_group=ONE,
            device=CPU,
            records=ParamRecords(),
            buffers=ReusableBuffers(CPU),
        )
        for g in groups
    ]
    grads = [torch.randn(flat.layout.shard_numel).bfloat16() for flat in flats]
    masters = [torch.nn.Parameter(flat.shard.float()) for flat in flats]  # reference: fp32 copies, one call
    for master, grad in zip(masters, grads):
        master.grad = grad.float() * 0.5
    torch.optim.AdamW(masters, lr=0.1).step()

    state = DeviceState(flats, [0, 0], [{"params": [p for g in groups for p in g]}], _adamw, torch.float32)
    kept = [grad.clone() for grad in grads]
    state.step([ResidentGrad(g, "device") for g in grads], coef=0.5)
    for flat, master, sub in zip(flats, masters, state.subgroups):
        assert torch.equal(sub.param, master.detach()) and torch.equal(flat.shard, master.detach().bfloat16())
    assert all(torch.equal(a, b) for a, b in zip(grads, kept))  # the 16-bit shards are not scaled in place


def test_the_offload_plan_chooses_the_home():
    def build(plan):
        params = _params()
        return build_optimizer_state(
            [_flat(params)],
            group_of_flat=[0],
            param_groups=[{"params": params}],
            make_optimizer=_adamw,
            master_dtype=torch.float32,
            offload=plan,
            synchronize=None,
        )

    host = build(OffloadPlan(optimizer_device="cpu", sub_group_size=4))
    assert isinstance(host, HostState) and host.location == "host" and len(host.subgroups) == 3
    device = build(OffloadPlan())
    assert type(device) is DeviceState and device.location == "device" and len(device.subgroups) == 1
