"""The staging pool NVMe parameter homes share, drawn from by two threads (the training thread and an optimizer step
running behind the forward): a demand waits for the other thread's buffer, and a thread that holds every buffer
itself is told to raise ``buffer_count`` instead of waiting forever."""

import threading

import pytest

from zeroshard.offload.param_store import BufferPool

HELD = 30.0


def test_a_demand_waits_for_the_buffer_another_thread_gives_back():
    pool = BufferPool(2, 4096, pin=False)
    mine = pool.acquire()
    assert pool.try_acquire() is None  # the read-ahead keeps the last buffer back for demands
    taken, give = threading.Event(), threading.Event()

    def other_thread():
        buffer = pool.acquire()  # the last one
        taken.set()
        assert give.wait(HELD)
        pool.give_back(buffer)

    worker = threading.Thread(target=other_thread)
    worker.start()
    assert taken.wait(HELD)
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire()))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not got  # nothing free: waiting, not failing
    give.set()
    waiter.join(HELD)
    worker.join(HELD)
    assert len(got) == 1 and got[0].data_ptr() != mine.data_ptr()


def test_a_thread_holding_every_buffer_is_told_to_raise_buffer_count():
    pool = BufferPool(2, 4096, pin=False)
    held = [pool.acquire(), pool.acquire()]
    with pytest.raises(AssertionError, match="raise offload_param.buffer_count"):
        pool.acquire()
    pool.give_back(held.pop())
    assert pool.acquire() is not None
