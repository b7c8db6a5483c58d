"""The comm seams as context managers: ``slow_collectives`` restores the link it replaced when its ``with`` block is
left, exception or not (a red-team run saw it fail after installing itself and slow the next engine), and
``compute_only`` blocks nest (an inner one's exit used to turn the outer one off). The host link seam queues each
direction's copies on a link of its bandwidth."""

import time

import pytest
import torch

from zeroshard.comm import DEFAULT_CONTEXT
from zeroshard.testing import compute_only, slow_collectives, slow_host_link


def test_slow_collectives_in_a_with_block_is_undone_on_exit_and_on_error():
    assert DEFAULT_CONTEXT.slow_link is None
    with slow_collectives(0.05) as link:
        assert DEFAULT_CONTEXT.slow_link is link and link.seconds == 0.05
        with slow_collectives(0.2, ops=("reduce_scatter",)) as inner:
            assert DEFAULT_CONTEXT.slow_link is inner
        assert DEFAULT_CONTEXT.slow_link is link  # the outer one is back
    assert DEFAULT_CONTEXT.slow_link is None
    with pytest.raises(RuntimeError, match="the step failed"):
        with slow_collectives(0.05):
            raise RuntimeError("the step failed")
    assert DEFAULT_CONTEXT.slow_link is None


def test_slow_collectives_called_without_with_stays_until_stopped():
    link = slow_collectives(0.05)
    try:
        assert DEFAULT_CONTEXT.slow_link is link
    finally:
        slow_collectives(0)
    assert DEFAULT_CONTEXT.slow_link is None


def test_compute_only_blocks_nest():
    assert not DEFAULT_CONTEXT.local_only()
    with compute_only():
        with compute_only():
            assert DEFAULT_CONTEXT.local_only()
        assert DEFAULT_CONTEXT.local_only()  # still inside the outer block
    assert not DEFAULT_CONTEXT.local_only()
    with pytest.raises(ValueError):
        with compute_only():
            raise ValueError("inside")
    assert not DEFAULT_CONTEXT.local_only()


def test_slow_host_link_queues_each_direction_and_is_undone_on_exit():
    """Each direction is one link: a copy issued while the link still carries an earlier one waits for it, the
    other direction does not, and the bytes each way are counted. Copies issued long ago (``started`` in the past)
    are carried already, so nothing here sleeps but the last call."""
    from zeroshard import accelerator

    assert accelerator._host_link_seam is None
    with slow_host_link(1e9) as link:
        assert accelerator._host_link_seam is link
        long_ago = time.perf_counter() - 100.0
        accelerator.crossed(10**6, True, long_ago)
        accelerator.crossed(2 * 10**6, True, long_ago)  # queued behind the first: done 3 ms after long_ago
        accelerator.crossed(10**6, False, long_ago)  # the other direction's link is free
        assert link._free_at[True] == pytest.approx(long_ago + 0.003)
        assert link._free_at[False] == pytest.approx(long_ago + 0.001)
        assert link.moved == {"to_host": 3 * 10**6, "to_device": 10**6} and link.waited_s == 0.0
        accelerator.crossed(2 * 10**8, False, time.perf_counter())  # 0.2 s of link from now: waited for
        assert link.waited_s > 0.0
        out = accelerator.copy_across(torch.empty(4), torch.ones(4), to_host=True)
        assert torch.equal(out, torch.ones(4)) and link.moved["to_host"] == 3 * 10**6 + 16
    assert accelerator._host_link_seam is None
    with pytest.raises(RuntimeError, match="failed"):
        with slow_host_link(1e9):
            raise RuntimeError("the step failed")
    assert accelerator._host_link_seam is None


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, "10e9", True, None])
def test_slow_host_link_refuses_a_bandwidth_that_is_not_a_finite_number(bad):
    from zeroshard import accelerator

    with pytest.raises((TypeError, ValueError), match="slow_host_link: bytes_per_second"):
        slow_host_link(bad)
    assert accelerator._host_link_seam is None
