"""The memory of a training process that is not the model's: the runtime (probed once in a child process) and
what glibc's allocator keeps resident.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import subprocess
import sys

from .result import cpu_only

GLIBC_MMAP_THRESHOLD_MAX = 32 * 2**20  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit glibc


def allocator_retention(largest_transient: int) -> int:
    """Freed memory the host allocator keeps resident, on a CPU run with glibc (0 elsewhere: on GPU the peak is
    ``max_memory_allocated``, which excludes the caching allocator's reserve).

    glibc returns a freed block to the system at once only while it was ``mmap``-ed; each such free raises the
    mmap threshold to the block's size (up to 32 MiB) and the heap's trim threshold to twice that, so after the
    first step a training process's transient tensors (the largest: a fresh parameter gradient or the logits)
    live on the heap, which keeps up to the trim threshold free at its top, and more in holes. The rule, twice the
    trim threshold, is the estimate's roughest term: on the example GPT the resident excess over the tensors in
    use measured 14, 55-60 and 120-140 MiB at 3.3M, 23M and 91M parameters, against 2, 64 and 96 predicted."""
    if not cpu_only() or platform.libc_ver()[0] != "glibc" or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return 0
    return 4 * min(largest_transient, GLIBC_MMAP_THRESHOLD_MAX)


_RUNTIME_PROBE = """
import json
import torch, torch.distributed as dist
import zeroshard

def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS"))

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
base = rss()
engine, *_ = zeroshard.initialize(
    model=torch.nn.Linear(8, 8),
    config={"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}},
)
engine.backward(engine(torch.ones(1, 8)).sum())
engine.step()
print(json.dumps({"base": base, "warmup": rss() - base}))
"""


@functools.lru_cache(maxsize=1)
def runtime_baseline() -> tuple[int, int]:
    """On CPU: the resident memory of a process that imported torch and zeroshard and joined a Gloo group, and
    what its first training step adds before any model memory (thread pools, kernels' workspaces, the
    optimizer's and the engine's code paths), measured once in a child process. ``(0, 0)`` on a GPU machine,
    where device memory starts empty."""
    if not cpu_only() or not os.path.exists("/proc/self/status"):
        return 0, 0
    out = subprocess.run([sys.executable, "-c", _RUNTIME_PROBE], capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"zeroshard estimate: the runtime probe failed:\n{out.stderr[-2000:]}")
    probe = json.loads(out.stdout.strip().splitlines()[-1])
    return probe["base"], max(probe["warmup"], 0)
