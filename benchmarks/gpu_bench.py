"""bf16 training throughput of a ~1B-parameter GPT under zeroshard stages 0-3 on the visible GPUs (NCCL).

    python benchmarks/gpu_bench.py [--layers 20] [--width 2048] [--micro 8] [--seq 1024] [--steps 8]
    python benchmarks/gpu_bench.py --stages 2 3 --offload cpu --layers 12     # CPU offload, the step during backward
    python benchmarks/gpu_bench.py --stages 3 --compile                       # stage 3 eager and engine.compile()

Prints per stage: median step time, tokens/s, model FLOPs utilization (6 x parameters x tokens/s over
the GPU's dense bf16 peak, ``--peak_tflops``, default H200/H100 SXM 989) and peak device memory. With ``--offload
cpu`` each stage runs three ways: without offload, with ``offload_optimizer: cpu`` and its step during the GPU's
backward (``super_offload`` on, zeroshard's default beside a GPU), and with the step after backward (off); the ratio
column is each step over the same stage's without offload. With ``--compile`` each stage runs eager and with
``engine.compile()`` (inductor, each block compiled in place; the first steps, which compile, are not timed). Without a
GPU it runs on the CPU (a smoke test).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from zeroshard.testing import run_distributed
from zeroshard.testing.models import GPT, GPTConfig


def worker(cfg: GPTConfig, stage: int, micro: int, steps: int, super_offload=None, compiled: bool = False) -> dict:
    """``super_offload``: None without offload, else ``offload_optimizer: cpu`` with this ``super_offload``;
    ``compiled``: ``engine.compile()`` before the first step."""
    import zeroshard
    from zeroshard import comm
    from zeroshard.accelerator import get_accelerator

    accelerator = get_accelerator()
    accelerator.reset_peak_memory_stats()
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
    if super_offload is not None:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "super_offload": super_offload}
    with zeroshard.zero.Init(enabled=stage == 3):
        model = GPT(cfg)
    engine, *_ = zeroshard.initialize(model=model, config=config)
    if compiled:
        engine.compile()
    x = torch.randint(0, cfg.vocab_size, (micro, cfg.block_size), device=engine.device)
    times = []
    for _ in range(steps):
        accelerator.synchronize()
        started = time.perf_counter()
        engine.backward(engine(x, x))
        engine.step()
        engine.disk_io()  # waits for an offloaded step still running behind the next forward
        accelerator.synchronize()
        times.append(time.perf_counter() - started)
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "step_s": statistics.median(times[2:]),
        "peak_bytes": accelerator.max_memory_allocated(),
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
    parser.add_argument("--offload", choices=["none", "cpu"], default="none")
    parser.add_argument("--compile", action="store_true", help="each stage eager and with engine.compile()")
    args = parser.parse_args()
    gpu = torch.cuda.is_available()
    world = torch.cuda.device_count() if gpu else 1
    env = {"ZEROSHARD_ACCELERATOR": "cuda"} if gpu else {}
    cfg = GPTConfig(vocab_size=32000, block_size=args.seq, n_layer=args.layers, n_head=16, n_embd=args.width)
    ways = {"no offload": None} if args.offload == "none" else {"no offload": None, "cpu, step during backward":
                                                                 True, "cpu, step after backward": False}  # fmt: skip
    if args.compile:
        ways = {"no offload": None, "no offload, compiled": None}
    print("| stage | optimizer | parameters | GPUs | step s | step / no offload | tokens/s | MFU | peak device GiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for stage in args.stages:
        base = None
        for way, super_offload in ways.items():
            r = run_distributed(
                worker, world, cfg, stage, args.micro, args.steps, super_offload, "compiled" in way, env=env,
                timeout_s=600
            )[0]  # fmt: skip
            base = base or r["step_s"]
            tokens_per_s = args.micro * args.seq * r["world"] / r["step_s"]
            mfu = 6 * r["params"] * tokens_per_s / (args.peak_tflops * 1e12 * r["world"])
            print(
                f"| {stage} | {way} | {r['params'] / 1e9:.2f}B | {r['world']} | {r['step_s']:.3f} | "
                f"{r['step_s'] / base:.3f} | {tokens_per_s:,.0f} | {mfu:.1%} | {r['peak_bytes'] / 2**30:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
