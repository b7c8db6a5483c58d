"""``deepspeed.runtime.lr_schedules``'s classes answer the attributes DeepSpeed's own tests and clients read
(``tests/unit/runtime/test_lr_schedulers.py`` of DeepSpeed passes in compat mode: 82 of 82)."""

import math

import pytest
import torch

from zeroshard.compat.deepspeed.runtime import lr_schedules


def two_groups():
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(2)]
    return torch.optim.Adam([{"params": [params[0]], "lr": 0.1}, {"params": [params[1]], "lr": 0.2}])


def test_warmup_lr_inherits_each_groups_lr_and_answers_its_settings():
    sched = lr_schedules.WarmupLR(two_groups(), warmup_num_steps=10)
    assert sched.max_lrs == [0.1, 0.2] and sched.min_lrs == [0.0, 0.0]
    assert sched.warmup_num_steps == 10 and sched.warmup_type == "log"
    sched.step(10)
    assert sched.get_lr() == pytest.approx([0.1, 0.2])


def test_warmup_cosine_lr_ratio():
    sched = lr_schedules.WarmupCosineLR(two_groups(), total_num_steps=100, warmup_num_steps=10)
    assert sched.get_lr_ratio() == 0.0 and sched.get_lr() == [0.0, 0.0]
    sched.step(1)
    assert sched.get_lr_ratio() == pytest.approx(math.log(2) / math.log(10))
    assert sched.total_num_steps == 100


def test_one_cycle_and_lr_range_test_settings():
    optimizer = two_groups()
    cycle = lr_schedules.OneCycle(optimizer, cycle_min_lr=[0.001, 0.002], cycle_max_lr=0.1, cycle_first_step_size=100,
                                  cycle_second_step_size=0)  # fmt: skip
    assert cycle.step_ratio == 1.0 and cycle.min_lrs == [0.001, 0.002] and cycle.max_lrs == [0.1, 0.1]
    assert cycle.min_moms == [(0.8, 0.99)] * 2 and cycle.max_moms == [(0.9, 0.99)] * 2
    rrt = lr_schedules.LRRangeTest(two_groups(), lr_range_test_step_size=5)
    assert rrt.step_size == 5 and rrt.min_lr == [1e-3, 1e-3] and rrt.staircase is False
    with pytest.raises(TypeError, match="is not a subclass of torch.optim.Optimizer"):
        lr_schedules.LRRangeTest(object())
