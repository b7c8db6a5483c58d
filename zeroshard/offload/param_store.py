"""Where a stage-3 parameter shard lives between gathers when ``offload_param`` is on.

A flat group asks its home for the shard just before the all-gather (``get``), gives it back
(``release``), and writes the updated shard after the optimizer step (``write`` then ``flush``).
``HostShard`` keeps it in (pinned) host memory; ``NvmeShard`` keeps it in a swap file and stages it
through one of ``buffer_count`` host buffers of ``buffer_size`` elements, read ahead by ``fetch``.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Optional

import torch

from .aio import IOPending, SwapFile, align_up, aligned_empty


class HostShard:
    on_host = True

    def __init__(self, values: torch.Tensor, pin: bool):
        self.tensor = torch.empty(values.shape, dtype=values.dtype, pin_memory=pin)
        self.tensor.copy_(values)

    def fetch(self) -> None:
        pass

    def get(self) -> torch.Tensor:
        return self.tensor

    def release(self) -> None:
        pass

    def write(self, start: int, values: torch.Tensor) -> None:
        self.tensor[start : start + values.numel()].copy_(values)

    def flush(self) -> None:
        pass

    def bytes(self) -> dict[str, int]:
        return {"host": self.tensor.numel() * self.tensor.element_size(), "nvme": 0}


class QuantizedShard:
    """``zero_quantized_nontrainable_weights``: a frozen shard kept on the device as block-quantized int8 (ZeRO++'s
    MixZ++: 1 byte per element plus an fp32 scale per block, instead of 2 or 4), dequantized for each gather.
    Writes (a checkpoint load, ``GatheredParameters`` with a modifier) are staged whole and quantized at ``flush``."""

    on_host = False

    def __init__(self, values: torch.Tensor, codec):
        self.codec, self.dtype, self.numel = codec, values.dtype, values.numel()
        self.message = torch.empty(codec.message_nbytes(self.numel), dtype=torch.uint8, device=values.device)
        codec.compress(values, self.message)
        self._staged: Optional[torch.Tensor] = None

    def fetch(self) -> None:
        pass

    def get(self) -> torch.Tensor:
        values = torch.empty(self.numel, dtype=self.dtype, device=self.message.device)
        return self.codec.decompress(self.message, self.numel, values)

    def release(self) -> None:
        pass

    def write(self, start: int, values: torch.Tensor) -> None:
        if self._staged is None:
            self._staged = self.get()
        self._staged[start : start + values.numel()].copy_(values)

    def flush(self) -> None:
        if self._staged is not None:
            self.codec.compress(self._staged, self.message)
            self._staged = None

    def bytes(self) -> dict[str, int]:
        return {"device": self.message.numel(), "host": 0, "nvme": 0}


class BufferPool:
    """``count`` aligned host buffers; a buffer handed back with a pending write is reused only after it.

    Two threads draw from it: the training thread (gathers and their read-ahead) and an optimizer step running
    behind the forward (:mod:`zeroshard.zero.step_behind`), which stages the updated shards it writes. A demand
    waits while the other thread holds a buffer (it gives it back without waiting on this one: the read-ahead keeps
    one buffer back, the step holds one shard's at a time); a thread that holds every buffer itself is a
    ``buffer_count`` too small, an error."""

    def __init__(self, count: int, nbytes: int, pin: bool):
        self.count = count
        self.nbytes = nbytes
        self.bytes_in_memory = count * align_up(nbytes)
        self._free: deque[tuple[torch.Tensor, Optional[IOPending]]] = deque(
            (aligned_empty(nbytes, pin), None) for _ in range(count)
        )
        self._holder: dict[int, int] = {}  # data pointer of a buffer in use -> the thread that took it
        self._changed = threading.Condition()

    def try_acquire(self) -> Optional[torch.Tensor]:
        """A buffer for reading ahead, keeping one back so a demand read never waits on a prefetch."""
        with self._changed:
            if len(self._free) <= 1:
                return None
            buffer, pending = self._take()
        return _after(buffer, pending)

    def acquire(self) -> torch.Tensor:
        me = threading.get_ident()
        with self._changed:
            while not self._free:
                if list(self._holder.values()).count(me) == self.count:
                    raise AssertionError("every offload_param buffer is in use; raise offload_param.buffer_count")
                self._changed.wait()
            buffer, pending = self._take()
        return _after(buffer, pending)

    def _take(self) -> tuple[torch.Tensor, Optional[IOPending]]:
        buffer, pending = self._free.popleft()
        self._holder[buffer.data_ptr()] = threading.get_ident()
        return buffer, pending

    def give_back(self, buffer: torch.Tensor, pending: Optional[IOPending] = None) -> None:
        with self._changed:
            self._holder.pop(buffer.data_ptr(), None)
            self._free.append((buffer, pending))
            self._changed.notify_all()


def _after(buffer: torch.Tensor, pending: Optional[IOPending]) -> torch.Tensor:
    """``buffer`` once the write out of it (if any) is done."""
    if pending is not None:
        pending.wait()
    return buffer


class NvmeShard:
    on_host = True

    def __init__(self, values: torch.Tensor, file: SwapFile, pool: BufferPool):
        self.numel, self.dtype = values.numel(), values.dtype
        self.nbytes = self.numel * values.element_size()
        self.file, self.pool = file, pool
        self.offset = file.reserve(self.nbytes)
        self._buffer: Optional[torch.Tensor] = None
        self._reading: Optional[IOPending] = None
        self.is_master = False  # the optimizer's fp32 master lives in this region and writes it (share_as_master)
        self.write(0, values)
        self.flush()

    def share_as_master(self) -> tuple[SwapFile, int]:
        """From now on the optimizer keeps its fp32 master weights in this shard's region and writes the updated
        values there itself (4 bytes per element less on disk, and per step): this home stops writing, and drops
        a staged copy when told of an update, so the next ``get`` reads the new values."""
        self.is_master = True
        return self.file, self.offset

    def master_moved(self, file: SwapFile, offset: int) -> None:
        """The optimizer committed a speculated step whose master (this shard's new values) it wrote to another
        region (``NvmeOptimizerSwapper.commit``): read from there from now on; a copy staged from the old region is
        dropped."""
        self.file, self.offset = file, offset
        self.write(0, torch.empty(0, dtype=self.dtype))  # as any update of a shared master: drop the staged copy

    def _io_view(self) -> torch.Tensor:
        return self._buffer[: align_up(self.nbytes)]

    def _values(self) -> torch.Tensor:
        return self._buffer[: self.nbytes].view(self.dtype)

    def fetch(self) -> None:
        """Start reading the shard into a free buffer, if one is free."""
        if self._buffer is None and (buffer := self.pool.try_acquire()) is not None:
            self._buffer = buffer
            self._reading = self.file.submit(False, self._io_view(), self.offset)

    def get(self) -> torch.Tensor:
        if self._buffer is None:
            self._buffer = self.pool.acquire()
            self._reading = self.file.submit(False, self._io_view(), self.offset)
        if self._reading is not None:
            self._reading.wait()
            self._reading = None
        return self._values()

    def release(self) -> None:
        if self._buffer is not None:
            self.pool.give_back(self._buffer)
            self._buffer = None

    def write(self, start: int, values: torch.Tensor) -> None:
        """Overwrite part of the shard in the staging buffer (the whole shard is written between ``flush`` es)."""
        if self.is_master:  # the optimizer wrote the region: a copy read ahead is stale
            if self._reading is not None:
                self._reading.wait()
                self._reading = None
            self.release()
            return
        if self._buffer is None:
            self._buffer = self.pool.acquire()
        if self._reading is not None:  # a read-ahead still landing in this buffer
            self._reading.wait()
            self._reading = None
        self._values()[start : start + values.numel()].copy_(values)

    def flush(self) -> None:
        """Write the staged shard behind; the buffer returns to the pool once the write is done."""
        if self._buffer is not None and not self.is_master:
            self.pool.give_back(self._buffer, self.file.submit(True, self._io_view(), self.offset))
            self._buffer = None

    def bytes(self) -> dict[str, int]:
        return {"host": 0, "nvme": self.nbytes}
