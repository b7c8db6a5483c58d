"""Swap-file I/O: round trips through real files with O_DIRECT and with the buffered fallback,
the DeepSpeed ``aio`` knobs, and the errors a user sees for a bad path or a full disk."""

import os
import resource
import signal

import pytest
import torch

from zeroshard.offload.aio import ALIGNMENT, AioSettings, OffloadIOError, SwapFile, aligned_empty


def roundtrip(directory, settings, nbytes=3 * 1024 * 1024 + 123, direct=True):
    file = SwapFile(str(directory), "t.swap", settings, direct=direct)
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    out = aligned_empty(nbytes)
    out[:nbytes].copy_(data)
    first = file.reserve(1000)
    offset = file.reserve(nbytes)
    assert first == 0 and offset == ALIGNMENT  # regions are aligned
    file.submit(True, out, offset).wait()
    back = aligned_empty(nbytes)
    back.zero_()
    file.submit(False, back, offset).wait()
    assert torch.equal(back[:nbytes], data)
    assert os.listdir(directory) == []  # the swap file is unlinked at once: nothing left behind
    file.close()
    return file


@pytest.mark.parametrize(
    "settings",
    [
        AioSettings(),
        AioSettings(block_size=64 * 1024, queue_depth=4, threads=3),
        AioSettings(block_size=128 * 1024, queue_depth=2, threads=2, single_submit=True),
    ],
    ids=["defaults", "3-threads", "single-submit"],
)
def test_roundtrip_on_disk(tmp_path, settings):
    assert roundtrip(tmp_path, settings).direct  # a disk filesystem takes O_DIRECT
    file = roundtrip(tmp_path, settings, direct=False)
    assert not file.direct
    stats = file.stats  # the training thread's wait, split by direction (engine.exposed_wait's nvme_read / _write)
    assert stats.read_wait_s + stats.write_wait_s == pytest.approx(stats.wait_s)
    assert stats.read == stats.written > 0


def test_buffered_io_and_tmpfs(tmp_path):
    """Without O_DIRECT (filesystems that refuse it) transfers go through the page cache, same results."""
    file = SwapFile(str(tmp_path), "t.swap", AioSettings(threads=2), direct=False)
    file.reserve(10)
    assert not file.direct
    file.close()
    shm = os.path.join("/dev/shm", f"zeroshard-aio-{os.getpid()}")
    if os.path.isdir("/dev/shm"):
        os.makedirs(shm)
        try:
            roundtrip(shm, AioSettings(threads=2))  # tmpfs: O_DIRECT or the fallback, whichever the kernel allows
        finally:
            os.rmdir(shm)


def test_missing_and_unusable_paths(tmp_path):
    with pytest.raises(OffloadIOError, match="does not exist or is not a directory"):
        SwapFile(str(tmp_path / "nope"), "t.swap", AioSettings())
    (tmp_path / "plain").write_text("x")
    with pytest.raises(OffloadIOError, match="not a directory"):
        SwapFile(str(tmp_path / "plain"), "t.swap", AioSettings())
    with pytest.raises(OffloadIOError, match="cannot create swap file"):
        SwapFile("/proc", "t.swap", AioSettings())  # exists, but files cannot be created there


def test_file_size_limit_is_a_clear_error(tmp_path):
    """A size-limited file (RLIMIT_FSIZE, as `ulimit -f` sets) fails when space is claimed, not mid-step."""
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, old[1]))
    try:
        file = SwapFile(str(tmp_path), "t.swap", AioSettings())
        file.reserve(512 * 1024)
        with pytest.raises(OffloadIOError, match="file size limit") as info:
            file.reserve(4 << 20)
        assert "errno 27" in str(info.value) and file.path in str(info.value)
        assert f"reserve of {4 << 20} bytes at offset {512 * 1024}" in str(info.value)  # once it said "of 0 bytes"
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, handler)


def test_truncated_file_is_detected(tmp_path):
    file = SwapFile(str(tmp_path), "t.swap", AioSettings())
    offset = file.reserve(8192)
    os.ftruncate(file.fd, 0)  # someone else shrank the file
    with pytest.raises(OffloadIOError, match="truncated"):
        file.submit(False, aligned_empty(8192), offset).wait()


def test_with_several_threads_a_read_follows_the_write_in_flight_to_its_region(tmp_path):
    """Split across 4 threads, a read submitted while a write of the same region is in flight could have parts run
    before the write's: the read waits for the overlapping write at submission, and sees what it wrote."""
    file = SwapFile(str(tmp_path), "t.swap", AioSettings(block_size=64 * 1024, queue_depth=2, threads=4))
    nbytes = 16 * 1024 * 1024
    offset = file.reserve(nbytes)
    for round_ in range(4):
        data = aligned_empty(nbytes)
        data.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(round_)))
        writing = file.submit(True, data, offset)
        back = aligned_empty(nbytes)
        reading = file.submit(False, back, offset)
        assert writing.done()  # the read's submission waited for it
        reading.wait()
        writing.wait()
        assert torch.equal(back, data)
    file.close()
