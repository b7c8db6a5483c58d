"""How large a GPT can 2 ranks train on this machine, without offload, with CPU offload and with NVMe
offload; step time and memory per rank for each.

    python benchmarks/offload_capacity.py [--layers 4 16] [--width 1024] [--nvme_path /tmp]

Every mode runs ZeRO stage 3 (the most memory-frugal placement) with the model built under
``zero.Init`` (no rank ever holds the whole model), fp32, one micro-batch of 1 x 64 tokens:
- none: parameters, gradients, master weights and Adam state in memory (16 bytes/parameter over N);
- cpu: ``offload_optimizer`` + ``offload_param`` to CPU. On a machine without a GPU "device" and
  "host" memory are the same RAM, so this mode shows the cost of the copies, not a capacity gain;
- nvme: ``offload_optimizer`` + ``offload_param`` to NVMe: only gradient shards, staging buffers and
  the gathered unit stay in RAM.
For each mode the peak resident memory is measured at two model sizes; the slope (bytes of RAM per
parameter) and the disk's free space give the largest model that fits, which is reported as a
projection (a measured run at that size takes too long on 2 cores to repeat here). Both sizes should
have more blocks than the reductions and prefetches in flight (about 4), or the slope also counts
those bounded transients.

The ranks run with ``MALLOC_MMAP_THRESHOLD_=1048576`` (set here unless already set): glibc then
returns every freed block over 1 MiB to the OS at once instead of keeping it in its heap, which
lowers peak RSS a lot for the alternating gather/free pattern of stage 3 (and costs some speed).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))  # before any rank starts (they inherit it)
import shutil
import time

import torch

from zeroshard.accelerator import host_peak_rss
from zeroshard.testing import run_distributed
from zeroshard.testing.models import GPT, GPTConfig

RAM_BUDGET = 22 * 2**30  # of the 24 GiB: leave room for the OS and the launcher
SEQ = 64


def config(mode: str, nvme_path: str, block_numel: int) -> dict:
    zero = {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "gather_unit_classes": ["Block"],
        "sub_group_size": 50_000_000,
        "stage3_prefetch_bucket_size": block_numel,  # prefetch one block ahead
        "stage3_max_live_parameters": 3 * block_numel,
    }
    if mode in ("cpu", "nvme"):
        extra = {"nvme_path": nvme_path} if mode == "nvme" else {}
        zero["offload_optimizer"] = {"device": mode, **extra}
        zero["offload_param"] = {"device": mode, "max_in_cpu": 0, **extra}
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": zero,
        "steps_per_print": 1_000_000,
    }


def worker(cfg: GPTConfig, mode: str, nvme_path: str, steps: int) -> dict:
    import zeroshard
    from zeroshard import comm

    with zeroshard.zero.Init():
        model = GPT(cfg)
    block_numel = sum(p.numel() for p in model.blocks[0].parameters())
    engine, *_ = zeroshard.initialize(model=model, config=config(mode, nvme_path, block_numel))
    x = torch.randint(0, cfg.vocab_size, (1, SEQ))
    times = []
    for _ in range(steps):
        comm.barrier(engine.mesh.world)
        started = time.perf_counter()
        engine.backward(engine(x, x))
        engine.step()
        times.append(time.perf_counter() - started)
    where = engine.zero.state_bytes_by_location()
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "step_s": min(times[1:] or times),
        "peak_rss": host_peak_rss(),
        "ram_state": sum(where["device"].values()) + sum(where["host"].values()),
        "nvme_state": sum(where["nvme"].values()),
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, nargs=2, default=[6, 14])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--modes", nargs="+", default=["none", "cpu", "nvme"])
    parser.add_argument("--nvme_path", default="/tmp")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--check", type=int, metavar="LAYERS", help="only run this size (e.g. one past a projection)")
    args = parser.parse_args()
    free_disk = shutil.disk_usage(args.nvme_path).free
    print(
        f"2 ranks, stage 3, fp32, width {args.width}, {os.cpu_count()} cores; RAM budget {RAM_BUDGET / 2**30:.0f} GiB, "
        f"free disk at {args.nvme_path}: {free_disk / 2**30:.0f} GiB\n"
    )
    print("| mode | parameters | step s | peak RSS / rank GiB | model state in RAM / rank GiB | on disk / rank GiB |")
    print("|---|---|---|---|---|---|")
    projections = []
    for mode in args.modes:
        points = []
        for layers in [args.check] if args.check else args.layers:
            cfg = GPTConfig(vocab_size=8192, block_size=SEQ, n_layer=layers, n_head=16, n_embd=args.width)
            r = run_distributed(worker, 2, cfg, mode, args.nvme_path, args.steps, timeout_s=3600)[0]
            points.append(r)
            print(
                f"| {mode} | {r['params'] / 1e6:.0f}M | {r['step_s']:.2f} | {r['peak_rss'] / 2**30:.2f} | "
                f"{r['ram_state'] / 2**30:.2f} | {r['nvme_state'] / 2**30:.2f} |"
            )
        if args.check:
            continue
        small, large = points
        ram_per_param = 2 * (large["peak_rss"] - small["peak_rss"]) / (large["params"] - small["params"])
        base = 2 * small["peak_rss"] - ram_per_param * small["params"]
        fit_ram = (RAM_BUDGET - base) / ram_per_param
        disk_per_param = 2 * large["nvme_state"] / large["params"]
        fit = min(fit_ram, free_disk / disk_per_param) if disk_per_param else fit_ram
        time_per_param = large["step_s"] / large["params"]
        projections.append((mode, ram_per_param, disk_per_param, fit, fit * time_per_param))
    if not projections:
        return
    print(
        "\n| mode | RAM bytes / parameter (both ranks) | disk bytes / parameter | largest model (projected) "
        "| step s at that size (projected, linear) |"
    )
    print("|---|---|---|---|---|")
    for mode, ram, disk, fit, step in projections:
        print(f"| {mode} | {ram:.1f} | {disk:.1f} | {fit / 1e9:.2f}B | {step:.0f} |")


if __name__ == "__main__":
    main()
