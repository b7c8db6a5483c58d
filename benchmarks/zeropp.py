"""ZeRO++ quantized communication at stage 3 against plain stage 3: bytes on the wire, loss, weight error, step time.

    python benchmarks/zeropp.py [--worlds 2 4] [--steps 200] [--dtype bf16] [--out docs/zeropp]

The example GPT (examples/train_gpt.py: byte tokens of the shipped corpus) trains from the same seed on the same
micro-batches at stage 3 (every parameter gathered) as plain ZeRO-3, qwZ (``zero_quantized_weights``), qgZ
(``zero_quantized_gradients``) and both; on 4 ranks also hpZ (``zero_hpz_partition_size: 2``) alone and with both.
The systems take turns step by step in one process group. Per system: wire bytes per step of the parameter
all-gathers and of the gradient reduce-scatters (comm ledger), the median step time, the relative L2 distance of
the weights from plain stage 3's after 3 steps, and the loss of a fixed evaluation set after the last step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from onebit import DATA, MICRO, MODEL, timed_step  # noqa: E402  (the 1-bit benchmark's model, data and step)

from zeroshard.testing import run_distributed  # noqa: E402
from zeroshard.testing.models import GPT  # noqa: E402

LR = 1e-3
QW, QG = "zero_quantized_weights", "zero_quantized_gradients"


def systems(world: int) -> dict[str, dict]:
    plan = {"zero-3": {}, "qwZ": {QW: True}, "qgZ": {QG: True}, "qwZ+qgZ": {QW: True, QG: True}}
    if world >= 4:
        plan["hpZ"] = {"zero_hpz_partition_size": 2}
        plan["hpZ+qwZ+qgZ"] = {"zero_hpz_partition_size": 2, QW: True, QG: True}
    return plan


def weights(engine) -> torch.Tensor:
    return torch.cat([t.float().flatten() for t in engine.consolidated_state_dict(rank0_only=False).values()])


def worker(steps: int, dtype: str, data: str = "corpus") -> dict:
    import zeroshard
    from zeroshard import comm

    rank, world = comm.get_rank(), comm.get_world_size()
    engines = {}
    for name, extra in systems(world).items():
        torch.manual_seed(0)
        config = {
            "train_micro_batch_size_per_gpu": MICRO,
            "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **extra},
            "bf16": {"enabled": dtype == "bf16"},
        }
        engines[name], _, _, _ = zeroshard.initialize(model=GPT(MODEL), config=config)
    record = {name: {"loss": [], "times": [], "gather": [], "reduce": [], "other": []} for name in engines}
    after_three = {}
    for step in range(steps):
        x, y = DATA[data](10_000 * step + rank, MICRO)
        for name, engine in engines.items():
            loss, elapsed = timed_step(engine, x, y, world)
            rec = record[name]
            rec["loss"].append(loss)
            rec["times"].append(elapsed)
            totals = engine.comm_ledger.totals
            for kind, prefix in (("gather", "all_gather"), ("reduce", "reduce_scatter")):
                rec[kind].append(sum(t.wire_bytes for (op, _), t in totals.items() if op.startswith(prefix)))
            rec["other"].append(
                sum(
                    t.wire_bytes for (op, _), t in totals.items() if not op.startswith(("all_gather", "reduce_scatter"))
                )
            )
            if step == 2:
                after_three[name] = weights(engine)
    eval_x, eval_y = DATA[data](-1, 64)
    for name, engine in engines.items():
        with torch.no_grad():
            record[name]["eval_loss"] = engine(eval_x, eval_y).float().item()
        reference = after_three["zero-3"]
        record[name]["weight_error_3"] = ((after_three[name] - reference).norm() / reference.norm()).item()
    return record


def summarize(record: dict, world: int, dtype: str) -> list[dict]:
    base = record["zero-3"]
    rows = []
    for name, mine in record.items():
        rows.append(
            {
                "world": world,
                "dtype": dtype,
                "system": name,
                "gather_MB": statistics.mean(mine["gather"]) / 1e6,
                "reduce_MB": statistics.mean(mine["reduce"]) / 1e6,
                "other_MB": statistics.mean(mine["other"]) / 1e6,
                "gather_ratio": statistics.mean(mine["gather"]) / statistics.mean(base["gather"]),
                "reduce_ratio": statistics.mean(mine["reduce"]) / statistics.mean(base["reduce"]),
                "weight_error_3": mine["weight_error_3"],
                "eval_loss": mine["eval_loss"],
                "loss_diff": mine["eval_loss"] / base["eval_loss"] - 1,
                "train_loss_diff": statistics.mean(mine["loss"][-50:]) / statistics.mean(base["loss"][-50:]) - 1,
                "time_ratio": statistics.median(mine["times"][3:]) / statistics.median(base["times"][3:]),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=600)  # all systems well past the loss's early plateau
    parser.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    parser.add_argument("--data", default="corpus", choices=sorted(DATA))
    parser.add_argument("--out", default="docs/zeropp")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for world in args.worlds:
        started = time.perf_counter()
        record = run_distributed(worker, world, args.steps, args.dtype, args.data, timeout_s=3600)[0]
        rows += summarize(record, world, args.dtype)
        print(f"{world} ranks: {time.perf_counter() - started:.0f} s")
    lines = [
        "| ranks | system | all-gather MB/step | ratio | reduce-scatter MB/step | ratio | other MB/step | "
        "weight error after 3 steps | eval loss | diff | train loss diff (last 50) | step time |",
        "|" + "---|" * 12,
    ]
    for r in rows:
        lines.append(
            f"| {r['world']} | {r['system']} | {r['gather_MB']:.3f} | {r['gather_ratio']:.3f} | {r['reduce_MB']:.3f} | "
            f"{r['reduce_ratio']:.3f} | {r['other_MB']:.3f} | {r['weight_error_3']:.2e} | {r['eval_loss']:.4f} | "
            f"{100 * r['loss_diff']:+.2f}% | {100 * r['train_loss_diff']:+.2f}% | {r['time_ratio']:.2f} |"
        )
    table = "\n".join(lines)
    print(table)
    suffix = args.dtype if args.data == "corpus" else f"{args.dtype}_{args.data}"
    (out / f"zeropp_{suffix}.md").write_text(table + "\n")
    (out / f"zeropp_{suffix}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
