"""Stage 3's peak memory and step time against how far ahead it prefetches, with stage 2 for reference.

    python benchmarks/prefetch_depth.py [--size large] [--world 2] [--steps 10] [--depths 0 1 2 4 all]

Each configuration runs alone in fresh processes (a peak RSS is a process's), on the same GPT, data and seed:
stage 2, then stage 3 with ``Block`` gather units and ``stage3_prefetch_depth`` N (``all``: no depth limit, only
the element budget ``stage3_prefetch_bucket_size`` -- DeepSpeed's default 5e7 -- which is how zeroshard prefetched
before the depth existed). Reports rank 0's peak RSS, the median step time and its ratio to depth 1 (the default).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_time import batches, take_turns, zeroshard_system  # noqa: E402
from suite import SIZES, gpt_config, wire_bytes  # noqa: E402

from zeroshard.accelerator import host_peak_rss  # noqa: E402
from zeroshard.testing import run_distributed  # noqa: E402
from zeroshard.testing.models import GPTConfig  # noqa: E402

DEFAULT_BUCKET = 50_000_000  # DeepSpeed's stage3_prefetch_bucket_size


def alone(cfg: GPTConfig, stage: int, depth, micro: int, steps: int, warmup: int) -> dict:
    from zeroshard import comm

    extra = {"stage3_prefetch_bucket_size": DEFAULT_BUCKET}
    if depth is not None:
        extra["stage3_prefetch_depth"] = 10**6 if depth == "all" else int(depth)
    step = zeroshard_system(cfg, 1e-4, stage, micro, extra_zero=extra)
    result = take_turns({"run": step}, batches(cfg, steps, micro, comm.get_rank()), warmup, wire_bytes)["run"]
    return {"step_s": statistics.median(result["times"]), "peak_rss": host_peak_rss(), "loss": result["loss"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="large", choices=sorted(SIZES))
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--depths", nargs="+", default=["0", "1", "2", "4", "all"])
    args = parser.parse_args()
    cfg = gpt_config(args.size)
    runs = [("stage 2", 2, None)] + [(f"stage 3, depth {d}", 3, d) for d in args.depths]
    rows = {}
    for label, stage, depth in runs:
        rows[label] = run_distributed(  # fresh interpreters, as launched: a peak RSS is a whole process's
            alone,
            args.world,
            cfg,
            stage,
            depth,
            args.micro,
            args.steps,
            args.warmup,
            timeout_s=3600,
            fresh_interpreters=True,
        )[0]
        print(f"{label}: {rows[label]}", flush=True)
    base = rows.get("stage 3, depth 1", next(iter(rows.values())))["step_s"]
    print(f"\nGPT {args.size}, {args.world} Gloo ranks, fp32, micro-batch {args.micro} x 64 tokens, Block units")
    print("| configuration | peak RSS rank 0 (MiB) | median step (ms) | step / depth 1 | final loss |")
    print("|---|---|---|---|---|")
    for label, r in rows.items():
        print(
            f"| {label} | {r['peak_rss'] / 2**20:.0f} | {1e3 * r['step_s']:.1f} | {r['step_s'] / base:.3f} "
            f"| {r['loss']:.4f} |"
        )


if __name__ == "__main__":
    main()
