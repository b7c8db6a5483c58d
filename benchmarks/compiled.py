"""Compiled training: zeroshard stage 3 with ``engine.compile()`` (inductor, each block compiled in place) against
the compiled compute-only limit (the same model, each block compiled the same way, no communication), against
itself eager, and against DeepSpeed's ZeRO-3 with its ``engine.compile()``, same model, data and global batch, one
run each (the systems take turns step by step, so machine noise hits all of them alike). zeroshard and DeepSpeed run
in two runs, each beside the limit: compiled in one process, the two frameworks' blocks share one dynamo cache (one
``Block.forward``) and evict each other's graphs (zeroshard's recompiled 7 times in a shared run).

    python benchmarks/compiled.py                                  # the small GPT (4 x 256)
    python benchmarks/compiled.py --n_layer 8 --n_embd 768 --vocab 16384 --seq 128 --micro 4 --steps 12  # 69.4M
    PYTHONPATH=/tmp/dsenv DS_ACCELERATOR=cpu python benchmarks/compiled.py     # with DeepSpeed 0.19.8 beside
    python benchmarks/compiled.py --memory      # peak RSS of zeroshard-3 eager and compiled, each run alone

Reports the median step after the warm-up, each system's first step (its compile, for the compiled ones), the
ratios the issue sets goals on (compiled zeroshard / compiled limit; the speedup compile gives zeroshard over the
one it gives the plain model), the final losses (zeroshard's compiled and eager agree; the limit's is its own data's)
and the graphs and graph breaks zeroshard's engine counted.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_time import batches, engine_step, limit_system, torch_step, zeroshard_system  # noqa: E402

from zeroshard.testing import run_distributed  # noqa: E402
from zeroshard.testing.models import GPT, GPTConfig  # noqa: E402

SYSTEMS = ["limit", "limit-compiled", "zeroshard-3", "zeroshard-3-compiled", "deepspeed-3", "deepspeed-3-compiled"]


def compiled_limit_system(cfg, lr):
    """The compute-only limit with each block compiled in place (what ``engine.compile()`` compiles)."""
    torch.manual_seed(0)
    model = GPT(cfg)
    for block in model.blocks:
        block.compile(backend="inductor")
    return torch_step(model, torch.optim.AdamW(model.parameters(), lr=lr, fused=True))


def deepspeed_system(cfg, lr, micro: int, compiled: bool):
    """DeepSpeed's ZeRO-3 on the same model (its torch AdamW: its fused kernels do not build on this CPU), with
    ``engine.compile()`` (which compiles the whole module in place); None where DeepSpeed does not import."""
    try:
        import deepspeed
    except ImportError:
        return None
    deepspeed.init_distributed(dist_backend="gloo")  # adopts the process group the harness made
    torch.manual_seed(0)
    model = GPT(cfg)
    block = sum(p.numel() for p in model.blocks[0].parameters())
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "torch_adam": True}},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "reduce_bucket_size": 2_000_000,
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": block,
        },
    }
    engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)[0]
    if compiled:
        engine.compile()
    return engine_step(engine)


def build(name: str, cfg: GPTConfig, micro: int):
    lr = 1e-3
    if name == "limit":
        return limit_system(cfg, lr)
    if name == "limit-compiled":
        return compiled_limit_system(cfg, lr)
    if name.startswith("deepspeed-3"):
        return deepspeed_system(cfg, lr, micro, compiled=name.endswith("compiled"))
    step = zeroshard_system(cfg, lr, 3, micro)
    if name.endswith("compiled"):
        step.engine.compile()
    return step


def worker(cfg: GPTConfig, steps: int, micro: int, warmup: int, names: list[str]) -> dict:
    import torch.distributed as dist

    from zeroshard import comm

    data = batches(cfg, steps, micro, comm.get_rank())
    systems = {name: build(name, cfg, micro) for name in names}
    systems = {name: step for name, step in systems.items() if step is not None}
    results = {name: {"times": [], "loss": None} for name in systems}
    for x, y in data:
        for name, step in systems.items():
            dist.barrier()
            started = time.perf_counter()
            loss = step(x, y)
            results[name]["times"].append(time.perf_counter() - started)
            results[name]["loss"] = loss.item()
    for name, step in systems.items():
        compiled = getattr(getattr(step, "engine", None), "compiled", None)
        results[name]["first"] = results[name]["times"][0]
        results[name]["times"] = results[name]["times"][warmup:]
        if compiled is not None:
            results[name]["graphs"] = compiled.graphs
            results[name]["breaks"] = sum(compiled.breaks.values())
    results["rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return results


def memory(cfg: GPTConfig, steps: int, micro: int) -> dict[str, float]:
    """Peak RSS (largest rank, MB) of zeroshard-3 eager and compiled, each alone in fresh interpreters."""
    peaks = {}
    for name in ("zeroshard-3", "zeroshard-3-compiled"):
        ranks = run_distributed(worker, 2, cfg, steps, micro, 1, [name], timeout_s=3600, fresh_interpreters=True)
        peaks[name] = max(r["rss_mb"] for r in ranks)
    return peaks


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n_layer", type=int, default=4)
    parser.add_argument("--n_embd", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=SYSTEMS)
    parser.add_argument("--memory", action="store_true", help="peak RSS of zeroshard-3 eager vs compiled instead")
    args = parser.parse_args()
    heads = 8 if args.n_embd >= 512 else 4
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.n_layer, n_head=heads, n_embd=args.n_embd)
    params = sum(p.numel() for p in GPT(cfg).parameters())
    print(f"GPT {params / 1e6:.2f}M params, 2 Gloo ranks, fp32, micro-batch {args.micro} x {cfg.block_size} tokens")
    if args.memory:
        for name, mb in memory(cfg, min(args.steps, 8), args.micro).items():
            print(f"| {name} | peak RSS {mb:.0f} MB |")
        return
    for group in ([n for n in args.systems if "deepspeed" not in n], [n for n in args.systems if "zeroshard" not in n]):
        if any(n.startswith(("zeroshard", "deepspeed")) for n in group):
            report(run_distributed(worker, 2, cfg, args.steps, args.micro, args.warmup, group, timeout_s=3600)[0])


def report(results: dict) -> None:
    """One run's table, and the ratios the issue sets goals on where its systems are there."""
    results.pop("rss_mb")
    med = {name: statistics.median(r["times"]) for name, r in results.items()}
    print("| system | median step (ms) | / limit | first step (s) | final loss | graphs / breaks |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        graphs = f"{r['graphs']} / {r['breaks']}" if "graphs" in r else "-"
        base = med["limit-compiled" if name.endswith("compiled") else "limit"] if "limit" in med else None
        ratio = f"{med[name] / base:.3f}" if base else "-"
        print(f"| {name} | {med[name] * 1e3:.1f} | {ratio} | {r['first']:.2f} | {r['loss']:.4f} | {graphs} |")
    for system in ("zeroshard-3", "deepspeed-3"):
        if {"limit", "limit-compiled", system, f"{system}-compiled"} <= set(med):
            gain, plain = med[system] / med[f"{system}-compiled"], med["limit"] / med["limit-compiled"]
            print(f"compile's speedup: {system} {gain:.3f}, plain model {plain:.3f}, ratio {gain / plain:.3f}")


if __name__ == "__main__":
    main()
