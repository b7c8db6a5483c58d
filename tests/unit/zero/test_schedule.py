"""The stage-3 gather schedule from a recorded unit order: the units ahead in forward and backward, and the reuse
distance that decides which units stay gathered (Note [reuse distance] in zero/stage3/schedule.py)."""

import pytest

from zeroshard.zero.stage3.schedule import GatherSchedule

SIZES = {"a": 10, "b": 20, "c": 30, "d": 40}


def schedule(order, distance=0):
    return GatherSchedule(list(order), SIZES.__getitem__, distance)


def test_units_ahead_follow_the_recorded_order_forward_and_reversed_in_backward():
    s = schedule("abcd")
    assert s.ahead_in_forward(0) == ("b", "c", "d") and s.ahead_in_forward(3) == ()
    assert s.ahead_in_backward("d") == ("c", "b", "a")
    assert s.ahead_in_backward("b") == ("a",) and s.ahead_in_backward("a") == ()
    assert s.ahead_in_backward("x") == ()  # not run by this forward


def test_reuse_distance_counts_the_elements_run_before_the_next_use():
    s = schedule("abcd")
    # a: b, c, d forward then d, c, b backward before a's backward
    assert [s.reuse_distance(i) for i in range(4)] == [180, 140, 80, 0]
    assert [s.keeps(i) for i in range(4)] == [False, False, False, True]  # 0: only the last unit of forward
    assert [schedule("abcd", 80).keeps(i) for i in range(4)] == [False, False, True, True]
    assert all(schedule("abcd", 10**9).keeps(i) for i in range(4))  # DeepSpeed's default: every unit of a small model


def test_a_unit_run_twice_is_next_used_by_its_second_call():
    s = schedule("abab")  # a, b, a again, b; then backward: b, a, b, a
    assert [s.reuse_distance(i) for i in range(4)] == [20, 10, 40, 0]  # a's second call: b's forward and backward
    assert s.ahead_in_backward("b") == ("a",)  # the last forward use decides where backward reaches it
    assert s.ahead_in_backward("a") == ("b",)
    thrice = schedule("aba" + "a")  # a run three times: its repeats between two uses are not other units
    assert thrice.reuse_distance(0) == 20 and thrice.reuse_distance(2) == 0


@pytest.mark.parametrize("recorded, follows", [("a", True), ("ab", True), ("ac", False), ("abcde", False)])
def test_a_forward_follows_the_schedule_while_it_runs_its_units_in_order(recorded, follows):
    assert schedule("abcd").follows(list(recorded)) is follows


def test_an_empty_schedule_keeps_nothing_and_has_nothing_ahead():
    s = schedule("")
    assert len(s) == 0 and s.ahead_in_backward("a") == () and not s.follows(["a"])
