"""bf16 training throughput of a ~1B-parameter GPT under zeroshard stages 0-3 on the visible GPUs (NCCL).

    python benchmarks/gpu_bench.py [--layers 20] [--width 2048] [--micro 8] [--seq 1024] [--steps 8]

Prints per stage: median step time, tokens/s, model FLOPs utilization (6 x parameters x tokens/s over
the GPU's dense bf16 peak, ``--peak_tflops``, default H200/H100 SXM 989) and peak device memory.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from zeroshard.testing import run_distributed
from zeroshard.testing.models import GPT, GPTConfig


def worker(cfg: GPTConfig, stage: int, micro: int, steps: int) -> dict:
    import zeroshard
    from zeroshard import comm

    torch.cuda.reset_peak_memory_stats()
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "steps_per_print": 10**9,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {
            "stage": stage,
            "overlap_comm": True,
            "gather_unit_classes": ["Block"],
            "stage3_param_persistence_threshold": 0,
        },
    }
    with zeroshard.zero.Init(enabled=stage == 3):
        model = GPT(cfg)
    engine, *_ = zeroshard.initialize(model=model, config=config)
    x = torch.randint(0, cfg.vocab_size, (micro, cfg.block_size), device=engine.device)
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        started = time.perf_counter()
        engine.backward(engine(x, x))
        engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "step_s": statistics.median(times[2:]),
        "peak_bytes": torch.cuda.max_memory_allocated(),
        "world": comm.get_world_size(),
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--peak_tflops", type=float, default=989.0)
    args = parser.parse_args()
    world = torch.cuda.device_count()
    cfg = GPTConfig(vocab_size=32000, block_size=args.seq, n_layer=args.layers, n_head=16, n_embd=args.width)
    print("| stage | parameters | GPUs | step s | tokens/s | MFU | peak device GiB |")
    print("|---|---|---|---|---|---|---|")
    for stage in args.stages:
        r = run_distributed(
            worker, world, cfg, stage, args.micro, args.steps, env={"ZEROSHARD_ACCELERATOR": "cuda"}, timeout_s=600
        )[0]
        tokens_per_s = args.micro * args.seq * r["world"] / r["step_s"]
        mfu = 6 * r["params"] * tokens_per_s / (args.peak_tflops * 1e12 * r["world"])
        print(
            f"| {stage} | {r['params'] / 1e9:.2f}B | {r['world']} | {r['step_s']:.3f} | {tokens_per_s:,.0f} | "
            f"{mfu:.1%} | {r['peak_bytes'] / 2**30:.1f} |"
        )


if __name__ == "__main__":
    main()
