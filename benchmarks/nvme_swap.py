"""NVMe swap bandwidth against the disk's sequential bandwidth, measured in the same run.

    python benchmarks/nvme_swap.py [--dir /tmp] [--gib 2]

Baseline: ``dd`` writing and reading a file of the same size with direct I/O (fsync at the end of
the write), with 1 MiB and with 8 MiB blocks; the ratios are against the faster of the two.
Measured: zeroshard's swap file (threads around ``os.pwritev`` /
``os.preadv``, O_DIRECT) with a few ``aio`` settings, moving the same bytes in sub-group sized
requests (256 MiB each) as the optimizer swapper does. The bar: >= 0.8 of the dd figures.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time

from zeroshard.offload.aio import AioSettings, SwapFile, aligned_empty

MIB = 1 << 20


def dd_bandwidth(directory: str, nbytes: int, block_mib: int) -> tuple[float, float]:
    path = os.path.join(directory, "zeroshard-dd-baseline")
    count = nbytes // (block_mib * MIB)
    try:
        started = time.perf_counter()
        subprocess.run(
            ["dd", "if=/dev/zero", f"of={path}", f"bs={block_mib}M", f"count={count}", "oflag=direct", "conv=fsync"],
            check=True,
            capture_output=True,
        )
        write = nbytes / (time.perf_counter() - started) / 1e9
        started = time.perf_counter()
        subprocess.run(
            ["dd", f"if={path}", "of=/dev/null", f"bs={block_mib}M", "iflag=direct"], check=True, capture_output=True
        )
        read = nbytes / (time.perf_counter() - started) / 1e9
    finally:
        if os.path.exists(path):
            os.remove(path)
    return write, read


def swap_bandwidth(directory: str, nbytes: int, settings: AioSettings, request: int = 256 * MIB) -> tuple[float, float]:
    file = SwapFile(directory, f"zeroshard-bench-{os.getpid()}", settings)
    buffers = [aligned_empty(request) for _ in range(2)]  # double-buffered, as the swapper's staging slots
    for buffer in buffers:
        buffer.fill_(7)
    offsets = [file.reserve(request) for _ in range(nbytes // request)]
    try:
        for write in (True, False):
            started = time.perf_counter()
            pending = [None, None]
            for i, offset in enumerate(offsets):
                if pending[i % 2] is not None:
                    pending[i % 2].wait()
                pending[i % 2] = file.submit(write, buffers[i % 2], offset)
            for p in pending:
                if p is not None:
                    p.wait()
            if write:
                os.fsync(file.fd)
                write_gbs = nbytes / (time.perf_counter() - started) / 1e9
            else:
                read_gbs = nbytes / (time.perf_counter() - started) / 1e9
    finally:
        file.close()
    return write_gbs, read_gbs


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default="/tmp")
    parser.add_argument("--gib", type=float, default=2.0)
    args = parser.parse_args()
    nbytes = int(args.gib * 1024) * MIB
    baselines = {mib: dd_bandwidth(args.dir, nbytes, mib) for mib in (1, 8)}
    dd_write = max(w for w, _ in baselines.values())
    dd_read = max(r for _, r in baselines.values())
    print(f"{args.gib} GiB in {args.dir}\n")
    print("| I/O | write GB/s | read GB/s | write / best dd | read / best dd |")
    print("|---|---|---|---|---|")
    for mib, (write, read) in baselines.items():
        print(
            f"| dd, direct, {mib} MiB blocks | {write:.2f} | {read:.2f} | "
            f"{write / dd_write:.2f} | {read / dd_read:.2f} |"
        )
    settings = {
        "defaults (1 MiB blocks, depth 8, 1 thread)": AioSettings(),
        "1 MiB blocks, depth 8, 2 threads": AioSettings(threads=2),
        "1 MiB blocks, depth 32, 4 threads": AioSettings(queue_depth=32, threads=4),
        "1 MiB blocks, single submit, 1 thread": AioSettings(single_submit=True),
    }
    for name, setting in settings.items():
        write, read = swap_bandwidth(args.dir, nbytes, setting)
        print(f"| zeroshard swap, {name} | {write:.2f} | {read:.2f} | {write / dd_write:.2f} | {read / dd_read:.2f} |")


if __name__ == "__main__":
    main()
