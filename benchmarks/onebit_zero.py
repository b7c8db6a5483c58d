"""1-bit Adam at ZeRO stages 0, 1 and 2 on a short run with an early freeze: loss against uncompressed training.

    python benchmarks/onebit_zero.py [--worlds 2 4] [--steps 60] [--freezes 10 20 30] [--data corpus|markov]
        [--micro 8] [--out docs/onebit_zero]

The task of issue 31 as a user meets it: an example-style GPT (examples/train_gpt.py's byte tokens, 4 layers of
width 80, 0.33M parameters), 8 windows of 64 tokens per rank and step, lr 5e-3, betas (0.9, 0.999), 60 steps, and
``freeze_step`` at 1/6, 1/3 and 1/2 of the run (DeepSpeed's tutorial ratio is about 1/6 to 1/4). Every system
trains from the same seed on the same micro-batches, taking turns step by step in one process group: AdamW
(torch's, with bias correction) at stages 0, 1 and 2, the 1-bit rule uncompressed (OneBitAdam never frozen:
Adam without bias correction), and OneBitAdam at each stage and freeze. Per 1-bit run: the mean training loss of
the last 10 steps against AdamW's and the uncompressed rule's, and its wire bytes per compressed step against
AdamW's at the same stage (the comm ledger's counts, everything included: momentum, parameters, norms).
``--data markov``: fresh sequences of a fixed bigram language instead of the corpus, whose loss falls within the
run (on the corpus it stays near the byte unigram entropy for the first hundred steps).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from onebit import DATA, timed_step  # noqa: E402  (the 1-bit benchmark's data, 64-token windows, and step)

from zeroshard.testing import run_distributed  # noqa: E402
from zeroshard.testing.models import GPT, GPTConfig  # noqa: E402

MODEL = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=80)
MICRO = 8
LR = 5e-3
LAST = 10  # the loss is the mean over the last LAST steps


def systems(freezes: list[int], steps: int) -> dict[str, tuple[int, str, dict]]:
    plan = {f"adamw-{stage}": (stage, "AdamW", {}) for stage in (0, 1, 2)}
    plan["uncompressed"] = (0, "OneBitAdam", {"freeze_step": steps + 1})
    for freeze in freezes:
        for stage in (0, 1, 2):
            plan[f"1bit-{stage}-f{freeze}"] = (stage, "OneBitAdam", {"freeze_step": freeze})
    return plan


def worker(freezes: list[int], steps: int, micro: int, data: str) -> dict:

    import zeroshard
    from zeroshard import comm
    from zeroshard.zero import NonFiniteGradientError

    rank, world = comm.get_rank(), comm.get_world_size()
    engines = {}
    for name, (stage, optimizer, params) in systems(freezes, steps).items():
        torch.manual_seed(0)
        config = {
            "train_micro_batch_size_per_gpu": micro,
            "steps_per_print": 10**9,
            "optimizer": {"type": optimizer, "params": {"lr": LR, "betas": [0.9, 0.999], **params}},
            "zero_optimization": {"stage": stage},
        }
        engines[name], _, _, _ = zeroshard.initialize(model=GPT(MODEL), config=config)
    record = {name: {"loss": [], "bytes": []} for name in engines}
    for step in range(steps):
        x, y = DATA[data](10_000 * step + rank, micro)
        for name, engine in engines.items():
            rec = record[name]
            if rec.get("diverged") is None:
                try:
                    loss, _ = timed_step(engine, x, y, world)
                    rec["bytes"].append(sum(t.wire_bytes for t in engine.comm_ledger.totals.values()))
                except NonFiniteGradientError:  # every rank sees the same global norm: all stop this system together
                    rec["diverged"] = step
            rec["loss"].append(float("nan") if rec.get("diverged") is not None else loss)
    for name, engine in engines.items():
        record[name]["compressed_from"] = engine.zero.compressed_from
    record["num_params"] = sum(p.numel() for p in GPT(MODEL).parameters())
    return record


def summarize(record: dict, world: int, freezes: list[int], steps: int) -> list[dict]:
    def last(name: str) -> float:
        return statistics.mean(record[name]["loss"][-LAST:])

    rows = []
    for freeze in freezes:
        for stage in (0, 1, 2):
            name, adamw = f"1bit-{stage}-f{freeze}", f"adamw-{stage}"
            compressed = slice(freeze + 1, steps)  # the steps after the first compressed one (it gathers exactly)
            rows.append(
                {
                    "world": world,
                    "stage": stage,
                    "freeze": freeze,
                    "loss": last(name),
                    "vs_adamw": last(name) / last("adamw-0") - 1,
                    "vs_uncompressed": last(name) / last("uncompressed") - 1,
                    "byte_ratio": statistics.mean(record[name]["bytes"][compressed] or [math.nan])
                    / statistics.mean(record[adamw]["bytes"][compressed]),
                    "compressed_from": record[name]["compressed_from"],
                    "diverged": record[name].get("diverged"),
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--micro", type=int, default=MICRO, help="windows of 64 tokens per rank and step")
    parser.add_argument("--data", default="corpus", choices=sorted(DATA))
    parser.add_argument("--freezes", type=int, nargs="+", default=None, help="default: 1/6, 1/3, 1/2 of the steps")
    parser.add_argument("--out", default="docs/onebit_zero")
    args = parser.parse_args()
    freezes = args.freezes or [args.steps // 6, args.steps // 3, args.steps // 2]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, baselines = [], []
    for world in args.worlds:
        started = time.perf_counter()
        record = run_distributed(worker, world, freezes, args.steps, args.micro, args.data, timeout_s=3600)[0]
        rows += summarize(record, world, freezes, args.steps)
        baselines.append((world, statistics.mean(record["adamw-0"]["loss"][-LAST:]), record["num_params"]))
        baselines[-1] += (statistics.mean(record["uncompressed"]["loss"][-LAST:]),)
        print(f"{world} ranks: {time.perf_counter() - started:.0f} s")
    lines = ["| ranks | freeze | stage | loss (last 10) | vs AdamW | vs uncompressed | bytes vs AdamW, same stage |"]
    lines.append("|" + "---|" * 7)
    for r in rows:
        lines.append(
            f"| {r['world']} | {r['freeze']} | {r['stage']} | {r['loss']:.4f} | {100 * r['vs_adamw']:+.2f}% | "
            f"{100 * r['vs_uncompressed']:+.2f}% | {r['byte_ratio']:.3f} |"
            if r["diverged"] is None
            else f"| {r['world']} | {r['freeze']} | {r['stage']} | diverged at step {r['diverged']} | | | |"
        )
    for world, adamw, num_params, uncompressed in baselines:
        lines.append(
            f"\n{world} ranks: AdamW {adamw:.4f}, uncompressed 1-bit rule {uncompressed:.4f} ({num_params} params)"
        )
    table = "\n".join(lines)
    print(table)
    (out / "onebit_zero.md").write_text(table + "\n")
    (out / "onebit_zero.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
