"""Asynchronous file I/O without a compiler: positioned vectored reads and writes from a thread pool.

``os.preadv`` / ``os.pwritev`` release the GIL, so a few Python threads keep a disk busy while the
training thread computes. Files are opened with ``O_DIRECT`` where the filesystem allows it (no
page-cache copy; buffers, offsets and lengths are then multiples of ``ALIGNMENT``) and without it
where it does not (tmpfs, some network filesystems).

Mapping of the DeepSpeed ``aio`` keys: a request is cut into ``block_size`` blocks; one system call
submits ``queue_depth`` of them as one vectored call (``single_submit``: one block per call);
``intra_op_parallelism`` threads issue the calls of one request in parallel.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import astuple, dataclass

import torch

from ..partition import round_up

ALIGNMENT = 4096


class OffloadIOError(RuntimeError):
    """An offload read or write failed (disk full, I/O error, file gone); training cannot continue."""


class SwapChecksumError(OffloadIOError):
    """Bytes read back from a swap file differ from those written there (a damaged disk, a filesystem error,
    another process writing into the file)."""


def align_up(nbytes: int) -> int:
    """``nbytes`` rounded up to the I/O alignment."""
    return round_up(nbytes, ALIGNMENT)


def aligned_empty(nbytes: int, pin: bool = False) -> torch.Tensor:
    """A uint8 host tensor of ``align_up(nbytes)`` bytes starting on an ``ALIGNMENT`` boundary (for O_DIRECT)."""
    size = align_up(max(nbytes, 1))
    raw = torch.empty(size + ALIGNMENT, dtype=torch.uint8, pin_memory=pin)
    skip = -raw.data_ptr() % ALIGNMENT
    return raw[skip : skip + size]


def _memoryview(buffer: torch.Tensor) -> memoryview:
    if buffer.dtype != torch.uint8 or not buffer.is_contiguous() or buffer.device.type != "cpu":
        raise AssertionError("I/O buffers are contiguous uint8 host tensors")
    return memoryview((ctypes.c_char * buffer.numel()).from_address(buffer.data_ptr())).cast("B")


@dataclass(frozen=True)
class AioSettings:
    block_size: int = 1 << 20
    queue_depth: int = 8
    threads: int = 1
    single_submit: bool = False
    verify_reads: bool = False  # Note [swap checksums]

    @classmethod
    def from_config(cls, aio) -> "AioSettings":
        return cls(
            block_size=align_up(aio.block_size),
            queue_depth=aio.queue_depth,
            threads=aio.intra_op_parallelism,
            single_submit=aio.single_submit,
            verify_reads=aio.verify_reads,
        )


@dataclass
class IOStats:
    """What one swap file moved, and how long the training thread waited for it (the *exposed* wait: a transfer
    that finished while the thread computed costs nothing here)."""

    read: int = 0
    written: int = 0
    wait_s: float = 0.0
    read_s: float = 0.0  # seconds the I/O threads spent in reads (summed over threads)
    write_s: float = 0.0
    read_wait_s: float = 0.0  # wait_s, the part spent waiting for reads
    write_wait_s: float = 0.0  # and for writes
    checksum_s: float = 0.0  # seconds the I/O threads spent on checksums (Note [swap checksums]; summed over threads)

    def add(self, other: "IOStats") -> "IOStats":
        return IOStats(*(a + b for a, b in zip(astuple(self), astuple(other))))


_waits = threading.local()  # per thread: whether its waits are hidden behind the training thread's work


@contextmanager
def hidden_waits():
    """Waits on I/O in this block are not the training thread's (an optimizer step running behind the forward):
    they are left out of ``IOStats.wait_s``."""
    _waits.hidden = True
    try:
        yield
    finally:
        _waits.hidden = False


class IOPending:
    """A submitted read or write; ``wait`` returns when every block is done or raises ``OffloadIOError``."""

    def __init__(self, futures: list[Future], stats: IOStats, write: bool = False):
        self._futures = futures
        self._stats = stats
        self._write = write

    @classmethod
    def all_of(cls, pendings: list["IOPending"]) -> "IOPending":
        """One handle for several submissions (of one file; writes when the first is one)."""
        first = pendings[0] if pendings else None
        futures = [f for p in pendings for f in p._futures]
        return cls(futures, first._stats if first else IOStats(), first._write if first else False)

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def wait(self) -> None:
        if not self.done():
            started = time.perf_counter()
            for future in self._futures:
                future.exception()
            if not getattr(_waits, "hidden", False):
                waited = time.perf_counter() - started
                self._stats.wait_s += waited
                if self._write:
                    self._stats.write_wait_s += waited
                else:
                    self._stats.read_wait_s += waited
        errors = [f.exception() for f in self._futures]
        self._futures = []
        for error in errors:
            if error is not None:
                raise error


class SwapFile:
    """One swap file, read and written at explicit offsets. The file is unlinked right after it is
    opened, so it disappears when the process ends, however it ends (its space is freed with it)."""

    def __init__(self, directory: str, name: str, settings: AioSettings, direct: bool = True):
        self.settings = settings
        self.fd = -1
        self.path = os.path.join(directory, name)
        if not os.path.isdir(directory):
            raise OffloadIOError(f"nvme_path {directory!r} does not exist or is not a directory; create it first")
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL
        direct_flag = getattr(os, "O_DIRECT", 0) if direct else 0
        try:
            self.fd = os.open(self.path, flags | direct_flag, 0o600)
            self.direct = direct_flag != 0
        except OSError as error:
            if error.errno != errno.EINVAL:
                raise OffloadIOError(
                    f"cannot create swap file {self.path}: {error.strerror} (errno {error.errno}); "
                    "nvme_path must be a writable directory on a local disk"
                ) from error
            self.fd = os.open(self.path, flags, 0o600)  # this filesystem refuses O_DIRECT
            self.direct = False
        os.unlink(self.path)
        self.size = 0
        self.stats = IOStats()
        self._writing: list[tuple[int, int, list[Future]]] = []  # writes in flight: [start, end) and their parts
        self._sums: dict[tuple[int, int], int] = {}  # Note [swap checksums]: (offset, length) -> checksum written
        # the training thread and an optimizer step running behind it (zeroshard.zero.step_behind) both submit;
        # the I/O threads add their seconds under a lock of their own
        self._lock, self._seconds_lock = threading.Lock(), threading.Lock()
        self._pool = ThreadPoolExecutor(settings.threads, thread_name_prefix="zeroshard-aio")
        if self.direct and not self._direct_works():
            plain = os.open(f"/proc/self/fd/{self.fd}", os.O_RDWR)  # same (unlinked) file, without O_DIRECT
            os.close(self.fd)
            self.fd, self.direct = plain, False

    def _direct_works(self) -> bool:
        """Some filesystems accept O_DIRECT at open and refuse it at the first transfer."""
        probe = aligned_empty(ALIGNMENT)
        try:
            os.pwritev(self.fd, [_memoryview(probe)], 0)
            return True
        except OSError as error:
            if error.errno != errno.EINVAL:
                raise self._error("probe write", 0, ALIGNMENT, error) from error
            return False
        finally:
            os.ftruncate(self.fd, 0)

    def reserve(self, nbytes: int) -> int:
        """Allocate an aligned region at the end of the file; disk space is claimed now, so a full disk
        fails here, with a clear error, rather than in the middle of a step."""
        offset, length = self.size, align_up(nbytes)
        try:
            os.posix_fallocate(self.fd, offset, length)
        except OSError as error:
            raise self._error("reserve", offset, length, error) from error
        self.size = offset + length
        return offset

    def _error(self, op: str, offset: int, nbytes: int, error: OSError) -> OffloadIOError:
        hint = {
            errno.ENOSPC: "the disk is full: free space or point nvme_path at a larger disk",
            errno.EFBIG: "the file size limit was hit (ulimit -f or the filesystem's limit)",
            errno.EDQUOT: "the disk quota is exhausted",
        }.get(error.errno, "check the disk and the nvme_path setting")
        return OffloadIOError(
            f"offload {op} of {nbytes} bytes at offset {offset} of swap file {self.path} failed: "
            f"{error.strerror or error} (errno {error.errno}); {hint}"
        )

    def _run(self, write: bool, view: memoryview, offset: int) -> None:
        """One system call per ``queue_depth`` blocks; short transfers are continued. With ``verify_reads`` the
        bytes written are summed first and those read back checked (Note [swap checksums])."""
        op = "write" if write else "read"
        started = time.perf_counter()
        try:
            key = (offset, len(view))
            if write and self.settings.verify_reads:
                self._sums.pop(key, None)  # while the write is in flight the region holds neither version
                written = self._checksum(view)
                self._transfer(write, view, offset, op)
                self._sums[key] = written
            else:
                self._transfer(write, view, offset, op)
                expected = self._sums.get(key) if self.settings.verify_reads else None
                if expected is not None and self._checksum(view) != expected:
                    raise SwapChecksumError(
                        f"offload read of {len(view)} bytes at offset {offset} of swap file {self.path}: the bytes "
                        "read back differ from those written there (their checksum does not match): the disk, the "
                        "filesystem or another process changed them. The training state in it is lost: resume from "
                        "the last checkpoint (and check the disk)"
                    )
        finally:
            with self._seconds_lock:
                if write:
                    self.stats.write_s += time.perf_counter() - started
                else:
                    self.stats.read_s += time.perf_counter() - started

    def _checksum(self, view: memoryview) -> int:
        started = time.perf_counter()
        total = checksum(view)
        with self._seconds_lock:
            self.stats.checksum_s += time.perf_counter() - started
        return total

    def _transfer(self, write: bool, view: memoryview, offset: int, op: str) -> None:
        block = self.settings.block_size
        depth = 1 if self.settings.single_submit else self.settings.queue_depth
        done = 0
        while done < len(view):
            chunk = view[done : done + block * depth]
            vectors = [chunk[i : i + block] for i in range(0, len(chunk), block)]
            try:
                count = (os.pwritev if write else os.preadv)(self.fd, vectors, offset + done)
            except OSError as error:
                raise self._error(op, offset + done, len(chunk), error) from error
            if count == 0:
                raise OffloadIOError(
                    f"offload {op} at offset {offset + done} of swap file {self.path} transferred nothing: "
                    "the file was truncated or the disk is full"
                )
            done += count

    def submit(self, write: bool, buffer: torch.Tensor, offset: int) -> IOPending:
        """Start reading into (or writing from) ``buffer`` at file ``offset``; split across the threads."""
        view = _memoryview(buffer)
        if self.direct and (offset % ALIGNMENT or len(view) % ALIGNMENT or buffer.data_ptr() % ALIGNMENT):
            raise AssertionError("O_DIRECT transfers need aligned offsets, lengths and buffers")
        if offset + len(view) > self.size:
            raise AssertionError(f"transfer [{offset}, {offset + len(view)}) outside the reserved {self.size} bytes")
        parts = self.settings.threads
        step = align_up(-(-len(view) // parts))
        if parts > 1:
            self._order_after_writes(offset, offset + len(view))
        with self._lock:
            if write:
                self.stats.written += len(view)
            else:
                self.stats.read += len(view)
            run = self._run
            futures = [
                self._pool.submit(run, write, view[lo : lo + step], offset + lo) for lo in range(0, len(view), step)
            ]
            if parts > 1 and write:
                self._writing.append((offset, offset + len(view), futures))
        return IOPending(futures, self.stats, write)

    def _order_after_writes(self, start: int, end: int) -> None:
        """With several I/O threads a later request's parts can start before an earlier one's finish: a read (or
        write) of a region waits here for the writes in flight that overlap it, so it sees (or follows) them. One
        thread runs requests in the order they were submitted, which orders them already (a request submitted after
        another thread's, e.g. a gather's read after the step behind published its write, runs after it)."""
        with self._lock:
            self._writing = [(lo, hi, fs) for lo, hi, fs in self._writing if not all(f.done() for f in fs)]
            overlapping = [fs for lo, hi, fs in self._writing if lo < end and start < hi]
        for futures in overlapping:
            for future in futures:
                future.exception()  # wait; an error is raised by the request's own IOPending

    def close(self) -> None:
        if getattr(self, "fd", -1) >= 0:
            self._pool.shutdown(wait=True)
            os.close(self.fd)
            self.fd = -1

    def __del__(self):
        self.close()


# Note [swap checksums]: a swap file holds training state between its write and its read (master weights, moments,
# gradients, stage-3 parameter shards). Garbage in it (4 KiB of it was enough) trained on as NaN without a word; a
# DeepSpeed swap file carries no checksum either. Each transfer a thread runs is summed as it is written and checked
# when the same region is read back: the sum of every 4 KiB page's 64-bit words (wrapping), each page weighted by its
# position, so a changed word, a page of garbage, a stale page or two pages swapped all change it. It runs in the
# I/O threads at memory bandwidth (17 GiB/s on one core here, against 1.6 for CRC32). Regions never written, or
# written in other pieces, are not checked. Off by default: on this 2-core machine it took 4.4% of the NVMe step
# (0.25 s of I/O-thread time per rank, 210M GPT) and +3.4% of step time in a 6-pair A/B, above the 2% it had to
# stay under to be on by default (docs/benchmarks.md); ``aio.verify_reads: true`` turns it on.
_PAGE_WORDS = ALIGNMENT // 8


def checksum(view: memoryview) -> int:
    """The position-weighted sum of ``view``'s 4 KiB pages of 64-bit words (a tail shorter than a page summed
    alone), as one int."""
    whole = len(view) // ALIGNMENT * ALIGNMENT
    total = 0
    if whole:
        words = torch.frombuffer(view[:whole], dtype=torch.int64).view(-1, _PAGE_WORDS)
        weights = torch.arange(1, words.shape[0] + 1, dtype=torch.int64)
        total = int((words.sum(1) * weights).sum())
    if whole < len(view):
        total += sum(view[whole:].tobytes()) * (whole // ALIGNMENT + 1)
    return total


def measure_bandwidth(directory: str, nbytes: int, settings: AioSettings = AioSettings()) -> dict[str, float]:
    """Write then read ``nbytes`` through a swap file in ``directory`` the way offload does (O_DIRECT where the
    filesystem allows it, in one request split as ``settings`` say): bytes per second each way. The file is unlinked
    at once, like every swap file."""
    file = SwapFile(directory, f"zeroshard-probe-pid{os.getpid()}.swap", settings)
    try:
        offset = file.reserve(nbytes)  # a disk without room fails here, by name, before any memory is taken
        buffer = aligned_empty(nbytes)
        buffer.fill_(1)
        file.submit(True, buffer, offset).wait()
        os.fsync(file.fd)
        file.submit(False, buffer, offset).wait()
        return {"read": file.stats.read / file.stats.read_s, "write": file.stats.written / file.stats.write_s}
    finally:
        file.close()
