"""Predicted vs measured peak memory per rank: ``zeroshard.estimate`` against real 2-rank runs.

    python benchmarks/memory_estimate.py [--sizes small medium large] [--stages 0 1 2 3] [--world 2]

For each GPT size x ZeRO stage x (no offload, CPU optimizer offload) x (with, without activation checkpointing of
every block) a fresh set of ranks, started as a user starts them (``zeroshard --num_gpus``), trains ``--steps``
steps (default 10: a CPU run's peak creeps up over the first steps as the heap fragments) and reports its peak RSS
(CPU) or ``max_memory_allocated`` (GPU); the estimate is computed beforehand from the config and a meta model.
Prints a markdown table with the relative error.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from suite import SIZES, gpt_config  # noqa: E402

import zeroshard  # noqa: E402
from zeroshard.accelerator import get_accelerator, host_peak_rss  # noqa: E402
from zeroshard.testing.models import GPT, recompute_blocks  # noqa: E402

MICRO = 4


def build(cfg, recompute: bool) -> GPT:
    torch.manual_seed(0)
    model = GPT(cfg)
    return recompute_blocks(model) if recompute else model


def ds_config(stage: int, offload: bool) -> dict:
    zero = {"stage": stage, "overlap_comm": True, "reduce_bucket_size": 2_000_000}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
        zero["stage3_prefetch_bucket_size"] = 1  # one unit ahead
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": zero,
    }


def sample(cfg) -> tuple:
    x = torch.zeros(MICRO, cfg.block_size, dtype=torch.long)
    return (x, x)


def worker(args) -> None:
    """One rank, started by the zeroshard launcher: estimate first, as a training script would before building
    anything, then train and write the peak."""
    from zeroshard import comm

    cfg, config = gpt_config(args.size), ds_config(args.stage, args.offload)
    world = int(os.environ["WORLD_SIZE"])  # the launcher's, as a script knows it before the process group exists
    estimate = zeroshard.estimate(lambda: build(cfg, args.recompute), config, world, sample(cfg))
    engine, *_ = zeroshard.initialize(model=build(cfg, args.recompute), config=config)
    gen = torch.Generator().manual_seed(comm.get_rank())
    for _ in range(args.steps):
        x = torch.randint(0, cfg.vocab_size, (MICRO, cfg.block_size + 1), generator=gen)
        engine.backward(engine(x[:, :-1], x[:, 1:]))
        engine.step()
    measured = torch.cuda.max_memory_allocated() if get_accelerator().name == "cuda" else host_peak_rss()
    result = {"predicted": estimate.peak, "measured": measured, "table": estimate.table()}
    with open(os.path.join(args.out, f"rank{comm.get_rank()}.json"), "w") as f:
        json.dump(result, f)


def launch(size: str, stage: int, offload: bool, recompute: bool, world: int, steps: int) -> list[dict]:
    """Every rank's result, the ranks started as a user starts them (``zeroshard --num_gpus``: fresh interpreters;
    processes forked from a server that imported torch first hold ~70 MiB less resident, which a user's ranks do
    not)."""
    with tempfile.TemporaryDirectory() as out:
        command = [
            sys.executable, "-m", "zeroshard", "--num_gpus", str(world), os.path.abspath(__file__), "--worker",
            "--size", size, "--stage", str(stage), "--steps", str(steps), "--out", out,
            *(["--offload"] if offload else []), *(["--recompute"] if recompute else []),
        ]  # fmt: skip
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(world)]


def run(sizes, stages, world: int, steps: int, verbose: bool = False) -> list[dict]:
    rows = []
    for size in sizes:
        for stage in stages:
            for offload in (False, True) if stage else (False,):  # offload needs a sharded optimizer
                for recompute in (False, True):
                    ranks = launch(size, stage, offload, recompute, world, steps)
                    worst = max(ranks, key=lambda r: abs(r["predicted"] / r["measured"] - 1))
                    row = dict(size=size, stage=stage, offload=offload, recompute=recompute)
                    row.update(predicted=worst["predicted"], measured=worst["measured"])
                    row["error"] = row["predicted"] / row["measured"] - 1
                    if verbose:
                        print(worst["table"])
                    print(_line(row), flush=True)
                    rows.append(row)
    return rows


def _line(r: dict) -> str:
    return (
        f"| {r['size']} | {r['stage']} | {'cpu' if r['offload'] else 'none'} | {'yes' if r['recompute'] else 'no'} | "
        f"{r['predicted'] / 2**20:.0f} | {r['measured'] / 2**20:.0f} | {100 * r['error']:+.1f}% |"
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--stages", nargs="+", type=int, default=[0, 1, 2, 3])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--verbose", action="store_true", help="print each estimate's breakdown")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--size", help=argparse.SUPPRESS)
    parser.add_argument("--stage", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--offload", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--recompute", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    print("| size | stage | offload | recompute | predicted MiB | measured MiB | error |")
    print("|---|---|---|---|---|---|---|")
    rows = run(args.sizes, args.stages, args.world, args.steps, args.verbose)
    worst = max(abs(r["error"]) for r in rows)
    print(f"\nworst |error|: {100 * worst:.1f}% over {len(rows)} runs")


if __name__ == "__main__":
    main()
