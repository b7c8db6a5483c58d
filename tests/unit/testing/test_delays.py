"""The comm seams as context managers: ``slow_collectives`` restores the link it replaced when its ``with`` block is
left, exception or not (a red-team run saw it fail after installing itself and slow the next engine), and
``compute_only`` blocks nest (an inner one's exit used to turn the outer one off)."""

import pytest

from zeroshard.comm import DEFAULT_CONTEXT
from zeroshard.testing import compute_only, slow_collectives


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
