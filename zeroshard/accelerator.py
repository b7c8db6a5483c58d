"""Device abstraction: the same code path runs on CUDA (NCCL) and on CPU (Gloo)."""

from __future__ import annotations

import ctypes
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch


@dataclass(frozen=True)
class Accelerator:
    name: str  # "cuda" or "cpu"
    comm_backend: str  # "nccl" or "gloo"

    def device(self, device_index: Optional[int] = 0) -> torch.device:
        """This kind's device at ``device_index`` (the first by default; a CPU has no index)."""
        if self.name == "cpu":
            return torch.device("cpu")
        return torch.device(self.name, device_index)

    def set_device(self, device_index: int) -> None:
        if self.name == "cuda":
            torch.cuda.set_device(device_index)

    def supported_dtypes(self) -> list[torch.dtype]:
        """DeepSpeed's list form of :meth:`supports_dtype` (its tests pick their cases by it)."""
        return [d for d in (torch.float32, torch.bfloat16, torch.float16) if self.supports_dtype(d)]

    def supports_dtype(self, dtype: torch.dtype) -> bool:
        if self.name == "cuda" and dtype is torch.bfloat16:
            return torch.cuda.is_bf16_supported()
        return True

    @property
    def can_pin_memory(self) -> bool:
        """Page-locked host memory only helps (and only exists) with a device to copy to."""
        return self.name == "cuda"

    def synchronize(self, device_index: Optional[int] = None) -> None:
        """Wait for queued device work (e.g. non-blocking copies out of a host buffer about to be reused)."""
        if self.name == "cuda":
            torch.cuda.synchronize(device_index)

    def max_memory_allocated(self, device_index: Optional[int] = None) -> int:
        """Peak device bytes since the last reset; on CPU the process's peak resident set."""
        if self.name == "cuda":
            return torch.cuda.max_memory_allocated(device_index)
        return host_peak_rss()

    # -- DeepSpeed's accelerator interface (clients such as HF call these by name) --------------------------
    def device_name(self, device_index: Optional[int] = None) -> str:
        """``"cuda"`` / ``"cuda:1"``, or ``"cpu"`` (a CPU has no index)."""
        if device_index is None or self.name == "cpu":
            return self.name
        return f"{self.name}:{device_index}"

    def current_device(self) -> int:
        return torch.cuda.current_device() if self.name == "cuda" else 0

    def current_device_name(self) -> str:
        return self.device_name(self.current_device()) if self.name == "cuda" else "cpu"

    def device_count(self) -> int:
        """GPUs; on CPU, as DeepSpeed's CPU accelerator counts: ``LOCAL_SIZE`` (the node's ranks) when set, else 1."""
        if self.name == "cuda":
            return torch.cuda.device_count()
        local_size = os.environ.get("LOCAL_SIZE", "")
        return int(local_size) if local_size.isdigit() and int(local_size) > 0 else 1

    def is_available(self) -> bool:
        """The device can run work now (the CPU always can)."""
        return torch.cuda.is_available() if self.name == "cuda" else True

    def memory_allocated(self, device_index: Optional[int] = None) -> int:
        """Device bytes in use now; on CPU the process's resident set."""
        if self.name == "cuda":
            return torch.cuda.memory_allocated(device_index)
        return host_rss()

    def memory_reserved(self, device_index: Optional[int] = None) -> int:
        """Bytes the caching allocator holds; on CPU (no cache between torch and the OS) the resident set."""
        if self.name == "cuda":
            return torch.cuda.memory_reserved(device_index)
        return host_rss()

    def max_memory_reserved(self, device_index: Optional[int] = None) -> int:
        if self.name == "cuda":
            return torch.cuda.max_memory_reserved(device_index)
        return host_peak_rss()

    def memory_stats(self, device_index: Optional[int] = None) -> dict[str, int]:
        """torch's allocator statistics; on CPU the two DeepSpeed's CPU accelerator reports (current and peak)."""
        if self.name == "cuda":
            return dict(torch.cuda.memory_stats(device_index))
        return {"allocated_bytes.all.current": host_rss(), "allocated_bytes.all.peak": host_peak_rss()}

    def reset_peak_memory_stats(self, device_index: Optional[int] = None) -> None:
        """Start the peaks (allocated and reserved) again from now. On CPU the kernel's own peak resident set is
        reset, so ``max_memory_allocated`` stays a true peak rather than the largest of some samples."""
        if self.name == "cuda":
            torch.cuda.reset_peak_memory_stats(device_index)
        else:
            reset_host_peak_rss()

    def total_memory(self, device_index: Optional[int] = None) -> int:
        """The device's memory; on CPU the machine's (``MemTotal``)."""
        if self.name == "cuda":
            return torch.cuda.get_device_properties(self._index(device_index)).total_memory
        return (proc_field_kib("/proc/meminfo", "MemTotal") or 0) * 1024

    def available_memory(self, device_index: Optional[int] = None) -> int:
        """Bytes free on the device (the driver's count); on CPU what the kernel could give (``MemAvailable``)."""
        if self.name == "cuda":
            free, _total = torch.cuda.mem_get_info(self._index(device_index))
            return free
        return (proc_field_kib("/proc/meminfo", "MemAvailable") or 0) * 1024

    def allocatable_memory(self) -> int:
        """What this rank can still allocate on its device: on a GPU the driver's free bytes and what torch's
        caching allocator holds unused; on CPU the machine's available memory, shared by the node's ranks
        (``LOCAL_WORLD_SIZE``, which torchrun and ``zeroshard`` set)."""
        if self.name == "cuda":
            return self.available_memory() + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
        local = os.environ.get("LOCAL_WORLD_SIZE", "")
        return self.available_memory() // (int(local) if local.isdigit() and int(local) > 0 else 1)

    # -- RNG -------------------------------------------------------------------------------------------------
    def random(self):
        """torch's RNG module (``get_accelerator().random().fork_rng(...)``); on CPU one whose ``fork_rng`` also
        takes ``device_type="cpu"``, which torch's cannot (it asks ``torch.cpu`` for a generator state it lacks)."""
        return torch.random if self.name == "cuda" else _CPU_RANDOM

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)  # the CPU generator and every CUDA device's

    def get_rng_state(self, device_index: Optional[int] = None) -> torch.Tensor:
        """The device generator's state (the current device's by default); on CPU the CPU generator's."""
        if self.name == "cuda":
            return torch.cuda.get_rng_state(self._index(device_index))
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: Optional[int] = None) -> None:
        if self.name == "cuda":
            torch.cuda.set_rng_state(new_state, self._index(device_index))
        else:
            torch.set_rng_state(new_state)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed() if self.name == "cuda" else torch.initial_seed()

    def default_generator(self, device_index: Optional[int] = None) -> torch.Generator:
        if self.name == "cuda":
            return torch.cuda.default_generators[self._index(device_index)]
        return torch.default_generator

    # -- streams and events: on CPU torch's CPU stream, where work runs in order as issued ---------------------
    @property
    def Stream(self) -> type:  # noqa: N802 (DeepSpeed's name: a property giving the class)
        return torch.cuda.Stream if self.name == "cuda" else torch.cpu.Stream

    @property
    def Event(self) -> type:  # noqa: N802
        return torch.cuda.Event if self.name == "cuda" else torch.cpu.Event

    def stream(self, stream: Any):
        """A context making ``stream`` current."""
        return torch.cuda.stream(stream) if self.name == "cuda" else torch.cpu.stream(stream)

    def current_stream(self, device_index: Optional[int] = None):
        return torch.cuda.current_stream(device_index) if self.name == "cuda" else torch.cpu.current_stream()

    def default_stream(self, device_index: Optional[int] = None):
        return torch.cuda.default_stream(device_index) if self.name == "cuda" else torch.cpu.current_stream()

    # -- graph capture ---------------------------------------------------------------------------------------
    def create_graph(self):
        """A CUDA graph to capture into. A CPU has none: refused, since a capture that ran once and a replay that
        did nothing would hand back the first step's outputs for ever."""
        self._needs_graphs("create_graph")
        return torch.cuda.CUDAGraph()

    def capture_to_graph(self, graph: Any, pool: Any = None, stream: Any = None):
        self._needs_graphs("capture_to_graph")
        return torch.cuda.graph(graph, pool, stream)

    def replay_graph(self, graph: Any) -> None:
        self._needs_graphs("replay_graph")
        graph.replay()

    def is_current_stream_capturing(self) -> bool:
        return self.name == "cuda" and torch.cuda.is_current_stream_capturing()

    def _needs_graphs(self, call: str) -> None:
        if self.name != "cuda":
            raise GraphCaptureUnavailable(
                f"get_accelerator().{call}(): graph capture needs CUDA and this rank runs on {self.name}; run the "
                "model eagerly (DeepSpeed's enable_cuda_graph / graph capture off)"
            )

    # -- host memory and profiling ranges ----------------------------------------------------------------------
    def pin_memory(self, tensor: torch.Tensor, make_copy: bool = True, match_shape: bool = True) -> torch.Tensor:
        """A page-locked copy of ``tensor`` (or, with ``make_copy=False``, a fresh page-locked buffer of its shape,
        or of its element count without ``match_shape``). Pinning only exists with a device to copy to: on CPU
        the tensor itself (or a plain buffer), as DeepSpeed's CPU accelerator does."""
        if make_copy:
            return tensor.pin_memory() if self.can_pin_memory else tensor
        shape = tensor.shape if match_shape else (tensor.numel(),)
        return tensor.new_empty(shape, device="cpu", pin_memory=self.can_pin_memory)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() if self.can_pin_memory else False

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives on this accelerator's device kind."""
        return tensor.device.type == self.name

    def range_push(self, msg: str, domain: Any = None, category: Any = None) -> None:
        """Open a named range in the profiler's timeline (NVTX on CUDA; a CPU has no range API, so nothing)."""
        if self.name == "cuda":
            torch.cuda.nvtx.range_push(msg)

    def range_pop(self, domain: Any = None) -> None:
        if self.name == "cuda":
            torch.cuda.nvtx.range_pop()

    def _index(self, device_index: Optional[int]) -> int:
        return self.current_device() if device_index is None else device_index

    def is_bf16_supported(self) -> bool:
        return self.supports_dtype(torch.bfloat16)

    def is_fp16_supported(self) -> bool:
        return True

    def communication_backend_name(self) -> str:
        return self.comm_backend

    def empty_cache(self) -> None:
        if self.name == "cuda":
            torch.cuda.empty_cache()

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)  # also seeds every CUDA device


class _CpuRandom:
    """``torch.random`` with a ``fork_rng`` that forks the CPU generator when asked for the CPU device type (the
    CPU generator is the only one, and torch's own forks it in every case)."""

    def __getattr__(self, name: str):
        return getattr(torch.random, name)

    def fork_rng(
        self, devices=None, enabled: bool = True, _caller="fork_rng", _devices_kw="devices", device_type="cuda"
    ):
        if torch.device(device_type).type == "cpu":
            devices = []
        return torch.random.fork_rng(devices, enabled, _caller, _devices_kw, device_type)


_CPU_RANDOM = _CpuRandom()


class GraphCaptureUnavailable(NotImplementedError):
    """A graph-capture call on a device without graphs (a CPU)."""


# -- the link between the compute device and host memory ---------------------------------------------------------
# The copies of a training step that cross it (gradients to the host optimizer, updates and offloaded shards to the
# device, activations checkpointed on the host, offload_states) go through :func:`copy_across` or :func:`moved_across`,
# which tell the seam set here how many bytes crossed, which way, and when the copy was issued. The seam is for tests
# and benchmarks (``zeroshard.testing.slow_host_link``: a link of a given bandwidth, on a machine whose "device" is its
# host); without one, crossing costs nothing beyond the copy.
HostLinkSeam = Callable[[int, bool, float], None]  # (bytes, towards the host, time.perf_counter() at issue)
_host_link_seam: Optional[HostLinkSeam] = None


def set_host_link_seam(seam: Optional[HostLinkSeam]) -> Optional[HostLinkSeam]:
    """Make ``seam`` see every crossing copy of this process from now (None: none); returns the seam it replaces."""
    global _host_link_seam
    previous, _host_link_seam = _host_link_seam, seam
    return previous


def crossed(nbytes: int, to_host: bool, started: float) -> None:
    """``nbytes`` crossed between the compute device and host memory in a copy issued at ``started``."""
    if _host_link_seam is not None:
        _host_link_seam(nbytes, to_host, started)


def copy_across(dst: torch.Tensor, src: torch.Tensor, to_host: bool, non_blocking: bool = False) -> torch.Tensor:
    """``dst.copy_(src)`` where one of them is on the compute device and the other in host memory."""
    started = time.perf_counter()
    dst.copy_(src, non_blocking=non_blocking)
    crossed(src.numel() * src.element_size(), to_host, started)
    return dst


def moved_across(
    values: torch.Tensor, device: torch.device, to_host: bool, copy: bool = False, non_blocking: bool = False
) -> torch.Tensor:
    """``values.to(device)`` where that crosses between the compute device and host memory (``copy``: a new tensor
    even where ``values`` is on ``device`` already, as on a machine whose device is its host)."""
    started = time.perf_counter()
    moved = values.to(device, copy=copy, non_blocking=non_blocking)
    crossed(values.numel() * values.element_size(), to_host, started)
    return moved


def proc_field_kib(path: str, field: str) -> Optional[int]:
    """A ``Field:  N kB`` line of a /proc file (``/proc/self/status``, ``/proc/meminfo``), in KiB; None without it."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def host_rss() -> int:
    """This process's resident set now, in bytes (0 where /proc is unavailable)."""
    return (proc_field_kib("/proc/self/status", "VmRSS") or 0) * 1024


def reset_host_peak_rss() -> bool:
    """Start this process's peak resident set (VmHWM) again from the current one (Linux's ``clear_refs`` 5); False
    where the kernel does not allow it (then the peak stays the process's lifetime peak)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def host_peak_rss() -> int:
    """This process's peak resident set in bytes. Linux's VmHWM, not ``ru_maxrss``: a spawned process
    inherits its parent's ``ru_maxrss`` across fork and exec, so a worker started by a big parent would
    report the parent's peak."""
    peak = proc_field_kib("/proc/self/status", "VmHWM")
    if peak is not None:
        return peak * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def release_host_memory() -> None:
    """Hand freed heap memory back to the operating system (glibc's ``malloc_trim``; nothing elsewhere). After a
    large host tensor is freed, glibc raises its mmap threshold and serves the next ones from the heap, where a small
    live allocation above them keeps the whole span resident: code that allocates and frees one large tensor after
    another (zero.Init putting parameters away) would otherwise grow the resident set toward the sum of them."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim if sys.platform.startswith("linux") else False
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim = None

# host blocks from this size are mapped apart from the heap and unmapped when freed: 4 MiB keeps the resident set
# as flat as 1 MiB does (0.82 against 0.74 bytes per parameter over 2 ranks, 59M -> 210M GPT under NVMe offload)
# and maps a quarter as many blocks afresh (each costs page faults: 1 MiB made that step ~10% slower)
HEAP_MMAP_THRESHOLD = 4 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers (malloc.h)


def bound_host_heap() -> bool:
    """Make glibc map every host block of ``HEAP_MMAP_THRESHOLD`` bytes or more on its own and unmap it when freed,
    as ``MALLOC_MMAP_THRESHOLD_=4194304`` would; True when it took effect. NVMe offload calls it: there the model
    lives on disk, and what remains in RAM is transient -- gathered units, gradients, activations -- whose freed
    blocks glibc would otherwise keep in its heap (its threshold rises to each freed block's size, up to 32 MiB),
    so that the resident set grew with the model (10.4 bytes per parameter over 2 ranks between a 59M and a 210M
    GPT, against 0.7 with this; ``docs/benchmarks.md``). A threshold the user set in the environment is kept;
    nothing happens off glibc."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    # the trim threshold too: glibc doubled it with each raise of the mmap threshold before this call
    return bool(mallopt(_M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, 2 * HEAP_MMAP_THRESHOLD))


def get_accelerator() -> Accelerator:
    """CUDA when a GPU is visible, unless ZEROSHARD_ACCELERATOR=cpu forces the CPU path."""
    forced = os.environ.get("ZEROSHARD_ACCELERATOR", "").lower()
    if forced not in ("", "cpu", "cuda"):
        raise ValueError(f"ZEROSHARD_ACCELERATOR={forced!r}: expected 'cpu' or 'cuda'")
    if forced == "cuda" or (forced == "" and torch.cuda.is_available()):
        return Accelerator("cuda", "nccl")
    return Accelerator("cpu", "gloo")
