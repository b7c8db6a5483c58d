"""CPU Adam throughput against memory-copy bandwidth, measured in the same run.

    python benchmarks/cpu_adam.py [--numel 50_000_000] [--repeats 5]

An Adam step streams 7 x 4 bytes per fp32 parameter (reads parameter, gradient, both moments; writes
parameter and both moments). The baseline copies a buffer of the same size with ``Tensor.copy_``
(read + write counted). The brief's bar: Adam >= 0.8 of memory-copy bandwidth.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from zeroshard.ops.adam import CPUAdam


def median_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--numel", type=int, default=50_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    n = args.numel
    param = torch.nn.Parameter(torch.randn(n))
    param.grad = torch.randn(n)
    opt = CPUAdam([param], lr=1e-4, weight_decay=0.01)
    adam_s = median_seconds(opt.step, args.repeats)
    src, dst = torch.randn(n * 7 // 2), torch.empty(n * 7 // 2)  # 7 x 4 bytes per parameter: 3.5 n floats x 2
    copy_s = median_seconds(lambda: dst.copy_(src), args.repeats)
    adam_gbs = 7 * 4 * n / adam_s / 1e9
    copy_gbs = 2 * 4 * src.numel() / copy_s / 1e9
    print(f"{n / 1e6:.0f}M fp32 parameters, {torch.get_num_threads()} threads")
    print(
        f"CPUAdam step: {adam_s * 1e3:.1f} ms, {adam_gbs:.2f} GB/s; memory copy: {copy_gbs:.2f} GB/s; "
        f"ratio {adam_gbs / copy_gbs:.2f}"
    )


if __name__ == "__main__":
    main()
