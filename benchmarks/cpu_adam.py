"""CPU Adam throughput against memory-copy bandwidth, measured in the same run.

    python benchmarks/cpu_adam.py [--numel 10_000_000 50_000_000 100_000_000] [--repeats 5]

An Adam step streams 7 x 4 = 28 bytes per fp32 parameter (reads parameter, gradient, both moments;
writes parameter and both moments). The baseline copies a buffer of the same size with
``Tensor.copy_`` (read + write counted). Compared: zeroshard's CPUAdam (torch's fused CPU kernel, no
compiler) and ``torch.optim.AdamW`` with the foreach and the per-tensor (for-loop) implementations.
The brief's bar: CPU Adam >= 0.8 of memory-copy bandwidth.
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


def copy_bandwidth(numel: int, repeats: int) -> float:
    src, dst = torch.randn(numel), torch.empty(numel)
    return 2 * 4 * numel / median_seconds(lambda: dst.copy_(src), repeats) / 1e9


def adam_seconds(make, n: int, repeats: int) -> float:
    param = torch.nn.Parameter(torch.randn(n))
    param.grad = torch.randn(n)
    opt = make([param])
    return median_seconds(opt.step, repeats)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--numel", type=int, nargs="+", default=[10_000_000, 50_000_000, 100_000_000])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    kinds = {
        "zeroshard CPUAdam": lambda p: CPUAdam(p, lr=1e-4, weight_decay=0.01),
        "torch AdamW foreach": lambda p: torch.optim.AdamW(p, lr=1e-4, weight_decay=0.01, foreach=True),
        "torch AdamW for-loop": lambda p: torch.optim.AdamW(p, lr=1e-4, weight_decay=0.01, foreach=False),
    }
    print(f"{torch.get_num_threads()} threads\n")
    print("| parameters | optimizer | step ms | Mparams/s | GB/s (28 B/param) | / memory copy |")
    print("|---|---|---|---|---|---|")
    for n in args.numel:
        copy_gbs = copy_bandwidth(n * 7 // 2, args.repeats)  # 28 bytes per parameter: 3.5 n floats read + written
        print(f"| {n / 1e6:.0f}M | memory copy | | | {copy_gbs:.2f} | 1.00 |")
        for name, make in kinds.items():
            seconds = adam_seconds(make, n, args.repeats)
            gbs = 28 * n / seconds / 1e9
            print(
                f"| {n / 1e6:.0f}M | {name} | {seconds * 1e3:.1f} | {n / seconds / 1e6:.0f} | {gbs:.2f} | "
                f"{gbs / copy_gbs:.2f} |"
            )


if __name__ == "__main__":
    main()
