import math

import pytest
import torch

from zeroshard.optim import build_schedule


def opt(lr=0.1, cls=torch.optim.AdamW):
    return cls([torch.nn.Parameter(torch.zeros(2))], lr=lr)


def lrs(name, params, steps, optimizer=None):
    optimizer = optimizer or opt()
    sched = build_schedule(name, params, optimizer)
    out = [sched.get_last_lr()[0]]
    for _ in range(steps):
        sched.step()
        out.append(sched.get_last_lr()[0])
    return out  # out[0] is before any step(); out[k] after k steps


def test_warmup_lr_log_and_linear():
    curve = lrs("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 1.0, "warmup_num_steps": 10}, 12)
    assert curve[0] == 0.0 and curve[1] == 0.0  # step index 0: log(1) = 0
    assert curve[2] == pytest.approx(math.log(2) / math.log(10))
    assert curve[11] == 1.0 and curve[12] == 1.0
    lin = lrs(
        "WarmupLR", {"warmup_min_lr": 0.1, "warmup_max_lr": 1.1, "warmup_num_steps": 4, "warmup_type": "linear"}, 6
    )
    assert lin[1:6] == pytest.approx([0.1, 0.35, 0.6, 0.85, 1.1])


def test_warmup_lr_defaults_to_optimizer_lr_as_max():
    curve = lrs("WarmupLR", {"warmup_num_steps": 2, "warmup_type": "linear"}, 4, opt(lr=0.5))
    assert curve[-1] == 0.5


def test_warmup_decay_lr():
    curve = lrs(
        "WarmupDecayLR",
        {"total_num_steps": 20, "warmup_max_lr": 1.0, "warmup_num_steps": 10, "warmup_type": "linear"},
        21,
    )
    assert curve[6] == pytest.approx(0.5)  # index 5 of 10
    assert curve[11] == pytest.approx(1.0)  # index 10: (20-10)/(20-10)
    assert curve[16] == pytest.approx(0.5)  # index 15
    assert curve[21] == 0.0


def test_warmup_cosine_lr():
    curve = lrs(
        "WarmupCosineLR",
        {"total_num_steps": 20, "warmup_num_steps": 10, "warmup_type": "linear", "cos_min_ratio": 0.0},
        25,
        opt(lr=2.0),
    )
    assert curve[0] == 0.0
    assert curve[6] == pytest.approx(1.0)  # half-way through warmup: ratio 0.5
    assert curve[11] == pytest.approx(2.0 * (1 + math.cos(math.pi * 1 / 10)) / 2)
    assert curve[15] == pytest.approx(2.0 * (1 + math.cos(math.pi * 5 / 10)) / 2)
    assert curve[25] == pytest.approx(0.0)  # clamped at the end


def test_one_cycle_lr_and_momentum():
    o = opt()
    sched = build_schedule(
        "OneCycle",
        {
            "cycle_min_lr": 0.01,
            "cycle_max_lr": 0.1,
            "cycle_first_step_size": 4,
            "decay_lr_rate": 0.5,
            "decay_step_size": 2,
        },
        o,
    )
    assert o.param_groups[0]["lr"] == 0.01 and o.param_groups[0]["betas"] == (0.8, 0.99)
    # DeepSpeed's TestOneCycle::test_mom: before the first step get_mom() answers cycle_max_mom (the first step's
    # value), while the optimizer starts at cycle_min_mom, as DeepSpeed sets it at construction
    assert sched.get_mom() == [(0.9, 0.99)]
    seen = []
    for _ in range(12):
        sched.step()
        seen.append((o.param_groups[0]["lr"], o.param_groups[0]["betas"][0]))
    assert seen[3] == pytest.approx((0.1, 0.8))  # peak lr, lowest momentum
    assert seen[7] == pytest.approx((0.01, 0.9))  # end of the cycle
    assert seen[9][0] == pytest.approx(0.01 / (1 + 0.5 * 2 / 2))  # decay phase


def test_lr_range_test():
    cont = lrs(
        "LRRangeTest", {"lr_range_test_min_lr": 0.1, "lr_range_test_step_size": 2, "lr_range_test_step_rate": 1.0}, 4
    )
    assert cont == pytest.approx([0.1, 0.15, 0.2, 0.25, 0.3])
    stair = lrs(
        "LRRangeTest", {"lr_range_test_min_lr": 0.1, "lr_range_test_step_size": 2, "lr_range_test_staircase": True}, 4
    )
    assert stair == pytest.approx([0.1, 0.1, 0.2, 0.2, 0.3])


def test_state_round_trip_and_errors():
    o = opt()
    s = build_schedule("WarmupLR", {"warmup_max_lr": 1.0, "warmup_num_steps": 10}, o)
    for _ in range(5):
        s.step()
    o2 = opt()
    s2 = build_schedule("WarmupLR", {"warmup_max_lr": 1.0, "warmup_num_steps": 10}, o2)
    s2.load_state_dict(s.state_dict())
    assert o2.param_groups[0]["lr"] == o.param_groups[0]["lr"]
    with pytest.raises(ValueError, match="scheduler.type"):
        build_schedule("Cosine", {}, opt())
    with pytest.raises(ValueError, match="rejected scheduler.params"):
        build_schedule("WarmupLR", {"warmup_steps": 3}, opt())
    with pytest.raises(ValueError, match="warmup_num_steps must be a positive integer"):
        build_schedule("WarmupLR", {"warmup_num_steps": 0}, opt())


def test_a_tensor_lr_keeps_its_identity():
    """DeepSpeed's schedules write into a caller's tensor lr in place (compiled optimizer steps hold it)."""
    lr = torch.tensor(0.1, dtype=torch.float64)
    o = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = build_schedule("WarmupLR", {"warmup_num_steps": 10}, o)
    sched.step(1)
    assert o.param_groups[0]["lr"] is lr and lr.item() == pytest.approx(0.1 * math.log(2) / math.log(10))
    assert sched.get_last_lr() == [pytest.approx(lr.item())]


def two_groups():
    return torch.optim.Adam(
        [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.1}, {"params": [torch.nn.Parameter(torch.zeros(1))],
                                                                        "lr": 0.2}],
        betas=(0.9, 0.99),
    )  # fmt: skip


@pytest.mark.parametrize(
    "name,params,said",
    [
        ("LRRangeTest", {"lr_range_test_step_size": 0}, "lr_range_test_step_size must be a positive integer"),
        ("LRRangeTest", {"lr_range_test_step_size": -5}, "lr_range_test_step_size must be a positive integer"),
        ("OneCycle", {"cycle_min_lr": 1e-3, "cycle_max_lr": 0.1, "cycle_first_step_size": 0},
         "cycle_first_step_size must be positive"),
        ("OneCycle", {"cycle_min_lr": 1e-3, "cycle_max_lr": 0.1, "cycle_first_step_size": -1},
         "cycle_first_step_size must be positive"),
        ("OneCycle", {"cycle_min_lr": 1e-3, "cycle_max_lr": 0.1, "cycle_second_step_size": -1},
         "cycle_second_step_size must be non-negative"),
        ("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1e-3}, "cycle_min_lr 0.1 is above cycle_max_lr 0.001"),
        ("WarmupLR", {"warmup_max_lr": -0.01}, "warmup_max_lr must be a finite learning rate >= 0"),
        ("WarmupDecayLR", {"total_num_steps": 10, "warmup_min_lr": float("nan")}, "warmup_min_lr must be a finite"),
        ("LRRangeTest", {"lr_range_test_min_lr": -1.0}, "lr_range_test_min_lr must be a finite learning rate"),
        ("OneCycle", {"cycle_min_lr": [1e-3, 2e-3, 3e-3], "cycle_max_lr": 0.1}, "expected 2 value\\(s\\), one per"),
        ("WarmupCosineLR", {"total_num_steps": 10, "cos_min_ratio": [0.1, 0.2]}, "takes one value for every"),
    ],
)  # fmt: skip
def test_schedule_parameters_are_checked_as_deepspeed_checks_them(name, params, said):
    """DeepSpeed (its tests/unit/runtime/test_lr_schedulers.py) raises a ValueError naming the parameter where these
    divided by zero or were silently accepted; a negative or NaN learning rate and a cycle that goes down are refused
    as a negative optimizer lr is."""
    with pytest.raises(ValueError, match=said):
        build_schedule(name, params, two_groups())


def test_one_cycle_takes_a_learning_rate_and_a_momentum_per_group():
    optimizer = two_groups()
    sched = build_schedule(
        "OneCycle",
        {"cycle_min_lr": [0.001, 0.002], "cycle_max_lr": [0.01, 0.02], "cycle_min_mom": [0.8, 0.85],
         "cycle_max_mom": [0.9, 0.95], "cycle_first_step_size": 5, "cycle_second_step_size": 5},
        optimizer,
    )  # fmt: skip
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.001, 0.002])
    assert [g["betas"][0] for g in optimizer.param_groups] == pytest.approx([0.8, 0.85])
    sched.step(4)  # the peak: each group its own maximum lr and minimum momentum
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.01, 0.02])
    assert [g["betas"][0] for g in optimizer.param_groups] == pytest.approx([0.8, 0.85])
    sched.step(9)
    assert [g["betas"][0] for g in optimizer.param_groups] == pytest.approx([0.9, 0.95])


def test_an_unknown_warmup_type_is_the_log_warmup_with_a_warning():
    with pytest.warns(UserWarning, match="warmup_type 'cosine' is not 'log' or 'linear': the log warmup is used"):
        odd = lrs("WarmupCosineLR", {"total_num_steps": 100, "warmup_num_steps": 10, "warmup_type": "cosine"}, 15)
    assert odd == lrs("WarmupCosineLR", {"total_num_steps": 100, "warmup_num_steps": 10}, 15)


def test_a_zero_second_half_cycle_is_allowed():
    curve = lrs("OneCycle", {"cycle_min_lr": 0.001, "cycle_max_lr": 0.1, "cycle_first_step_size": 100,
                             "cycle_second_step_size": 0}, 3)  # fmt: skip
    assert curve[0] == pytest.approx(0.001) and curve[3] > 0.001


@pytest.mark.parametrize(
    "name,params",
    [
        ("OneCycle", {"cycle_min_lr": 1e-3, "cycle_max_lr": 0.1, "cycle_min_mom": ["a", 0.8]}),
        ("OneCycle", {"cycle_min_lr": 1e-3, "cycle_max_lr": 0.1, "decay_lr_rate": float("nan")}),
        ("OneCycle", {"cycle_min_lr": 1e-3, "cycle_max_lr": 0.1, "cycle_second_stair_count": "2"}),
        ("WarmupDecayLR", {"total_num_steps": "100"}),
        ("LRRangeTest", {"lr_range_test_step_rate": float("inf")}),
        ("WarmupCosineLR", {"total_num_steps": 100, "cos_min_ratio": True}),
    ],
)
def test_a_schedule_parameter_that_is_not_a_finite_number_is_named(name, params):
    """Strings, NaN, infinity and switches where DeepSpeed's schedules compute with numbers: named when the schedule
    is built, not a TypeError at some later step."""
    with pytest.raises(ValueError, match=r"scheduler.params.\w+ must be a finite"):
        build_schedule(name, params, two_groups())
