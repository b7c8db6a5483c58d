"""1-bit optimizers against the same optimizer uncompressed: bytes on the wire, loss and step time, one run.

    python benchmarks/onebit.py [--worlds 2 4] [--steps 300] [--freeze 100] [--out docs/onebit]

The example GPT (examples/train_gpt.py: byte tokens of the shipped corpus) trains from the same seed on the
same micro-batches under 1-bit Adam at ZeRO stages 0, 1 and 2, each next to the same optimizer never frozen
(Adam without bias correction, uncompressed: the only difference is the compression and the frozen variance),
and 0/1 Adam and 1-bit LAMB (stage 0) next to their uncompressed runs. All systems take turns step by step in
one process group, so machine noise hits them alike. Per system, over the steps after the freeze: wire bytes
per step the comm ledger counted (gradient/momentum traffic apart from the parameter all-gather of stages 1-2),
the median step time, and the loss of a fixed evaluation set after the last step; plus the training-loss curves
as a PNG (needs matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from zeroshard.testing import run_distributed
from zeroshard.testing.models import GPT, GPTConfig

CORPUS = Path(__file__).resolve().parents[1] / "examples" / "data" / "corpus.txt"
MODEL = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)  # examples/train_gpt.py
MICRO = 8
LR = 1e-3
PARAMETER_TRAFFIC = ("all_gather",)  # stages 1-2: the updated shards, all-gathered after the step


def markov_windows(seed: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences of a fixed random bigram language (peaked transitions over the 256 byte tokens): unlimited fresh
    data whose loss falls smoothly towards the chain's entropy, no plateau and nothing to memorize."""
    transitions = (torch.randn(256, 256, generator=torch.Generator().manual_seed(12345)) * 3).softmax(-1)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.empty(count, MODEL.block_size + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, 256, (count,), generator=gen)
    for i in range(MODEL.block_size):
        tokens[:, i + 1] = torch.multinomial(transitions[tokens[:, i]], 1, generator=gen).squeeze(1)
    return tokens[:, :-1], tokens[:, 1:]


def windows(seed: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.tensor(list(CORPUS.read_bytes()), dtype=torch.long)
    starts = torch.randint(0, len(data) - MODEL.block_size - 1, (count,), generator=torch.Generator().manual_seed(seed))
    chunks = torch.stack([data[s : s + MODEL.block_size + 1] for s in starts.tolist()])
    return chunks[:, :-1], chunks[:, 1:]


DATA = {"corpus": windows, "markov": markov_windows}


def timed_step(engine, x: torch.Tensor, y: torch.Tensor, world: int) -> tuple[float, float]:
    """One training step after a barrier, the engine's ledger reset first: (the ranks' mean loss, seconds)."""
    import torch.distributed as dist

    engine.comm_ledger.reset()  # the ledger then holds this step's bytes only
    dist.barrier()
    started = time.perf_counter()
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    elapsed = time.perf_counter() - started
    mean_loss = loss.detach().float().clone()
    dist.all_reduce(mean_loss)
    return mean_loss.item() / world, elapsed


def systems(freeze: int, steps: int) -> dict[str, tuple[int, str, dict]]:
    """name -> (stage, optimizer, params); the uncompressed twin of each 1-bit run never reaches its freeze."""
    never = steps + 1
    plan = {}
    for stage in (0, 1, 2):
        plan[f"adam-{stage}"] = (stage, "OneBitAdam", {"freeze_step": never})
        plan[f"1bit-adam-{stage}"] = (stage, "OneBitAdam", {"freeze_step": freeze})
    plan["01adam-0"] = (0, "ZeroOneAdam", {"var_freeze_step": freeze})
    plan["lamb-0"] = (0, "OneBitLamb", {"freeze_step": never})
    plan["1bit-lamb-0"] = (0, "OneBitLamb", {"freeze_step": freeze})
    return plan


# (1-bit run, its uncompressed twin); 0/1 Adam's is plain Adam (its own schedule compresses from step 2 on)
PAIRS = [("1bit-adam-0", "adam-0"), ("1bit-adam-1", "adam-1"), ("1bit-adam-2", "adam-2")]
PAIRS += [("01adam-0", "adam-0"), ("1bit-lamb-0", "lamb-0")]


def worker(freeze: int, steps: int, beta2: float = 0.999, data: str = "corpus") -> dict:
    import zeroshard
    from zeroshard import comm

    rank, world = comm.get_rank(), comm.get_world_size()
    engines = {}
    for name, (stage, optimizer, params) in systems(freeze, steps).items():
        torch.manual_seed(0)
        config = {
            "train_micro_batch_size_per_gpu": MICRO,
            "steps_per_print": 10**9,
            "optimizer": {
                "type": optimizer,
                "params": {"lr": LR, "betas": [0.9, beta2], "weight_decay": 0.01, **params},
            },
            "zero_optimization": {"stage": stage, "overlap_comm": True, "reduce_bucket_size": 2_000_000},
        }
        engines[name], _, _, _ = zeroshard.initialize(model=GPT(MODEL), config=config)
    record = {name: {"loss": [], "times": [], "grad_bytes": [], "param_bytes": []} for name in engines}
    for step in range(steps):
        x, y = DATA[data](10_000 * step + rank, MICRO)
        for name, engine in engines.items():
            loss, elapsed = timed_step(engine, x, y, world)
            rec = record[name]
            rec["loss"].append(loss)
            if step >= freeze:
                totals = engine.comm_ledger.totals
                rec["times"].append(elapsed)
                rec["grad_bytes"].append(
                    sum(t.wire_bytes for (op, _), t in totals.items() if op not in PARAMETER_TRAFFIC)
                )
                rec["param_bytes"].append(sum(t.wire_bytes for (op, _), t in totals.items() if op in PARAMETER_TRAFFIC))
    eval_x, eval_y = DATA[data](-1, 64)
    for name, engine in engines.items():
        with torch.no_grad():
            record[name]["eval_loss"] = engine(eval_x, eval_y).item()
        record[name]["compressed_from"] = engine.zero.compressed_from
        record[name]["compression_bytes"] = engine.state_bytes()["compression_error"]
    record["num_params"] = sum(p.numel() for p in GPT(MODEL).parameters())
    return record


def summarize(record: dict, world: int) -> list[dict]:
    rows = []
    for name, base_name in PAIRS:
        mine, base = record[name], record[base_name]
        total_mine = statistics.mean(a + b for a, b in zip(mine["grad_bytes"], mine["param_bytes"]))
        total_base = statistics.mean(a + b for a, b in zip(base["grad_bytes"], base["param_bytes"]))
        rows.append(
            {
                "world": world,
                "system": name,
                "baseline": base_name,
                "grad_MB_per_step": statistics.mean(mine["grad_bytes"]) / 1e6,
                "baseline_grad_MB_per_step": statistics.mean(base["grad_bytes"]) / 1e6,
                "grad_ratio": statistics.mean(mine["grad_bytes"]) / statistics.mean(base["grad_bytes"]),
                "total_ratio": total_mine / total_base,
                "eval_loss": mine["eval_loss"],
                "baseline_eval_loss": base["eval_loss"],
                "loss_diff": mine["eval_loss"] / base["eval_loss"] - 1,
                "train_loss_diff": statistics.mean(mine["loss"][-50:]) / statistics.mean(base["loss"][-50:]) - 1,
                "time_ratio": statistics.median(mine["times"]) / statistics.median(base["times"]),
                "compressed_from": mine["compressed_from"],
                "compression_bytes_per_param": mine["compression_bytes"] / record["num_params"],
            }
        )
    return rows


def plot(records: dict[int, dict], out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot skipped: pip install matplotlib")
        return
    pairs = [(base, mine) for mine, base in PAIRS if mine != "1bit-adam-1"]
    fig, axes = plt.subplots(len(records), len(pairs), figsize=(4 * len(pairs), 3.2 * len(records)), squeeze=False)
    for row, (world, record) in enumerate(sorted(records.items())):
        for col, (base, mine) in enumerate(pairs):
            ax = axes[row][col]
            for name, style in ((base, "-"), (mine, "--")):
                losses = record[name]["loss"]
                smooth = [statistics.mean(losses[max(0, i - 9) : i + 1]) for i in range(len(losses))]
                ax.plot(smooth, style, label=name)
            ax.axvline(record[mine]["compressed_from"] or 0, color="grey", lw=0.8)
            ax.set_title(f"{mine} vs uncompressed, {world} ranks", fontsize=9)
            ax.set_xlabel("step")
            ax.set_ylabel("train loss (10-step mean)")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "onebit_loss.png", dpi=110)
    print(f"wrote {out / 'onebit_loss.png'}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--freeze", type=int, default=300)  # past the loss's breakout from its early plateau
    # the variance's time constant, 1 / (1 - beta2) steps: it has to have settled by the freeze
    parser.add_argument("--beta2", type=float, default=0.99)
    parser.add_argument("--data", default="corpus", choices=["corpus", "markov"])
    parser.add_argument("--out", default="docs/onebit")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records, rows = {}, []
    for world in args.worlds:
        started = time.perf_counter()
        records[world] = run_distributed(worker, world, args.freeze, args.steps, args.beta2, args.data, timeout_s=3600)[
            0
        ]
        rows += summarize(records[world], world)
        print(f"{world} ranks: {time.perf_counter() - started:.0f} s")
    header = (
        "| ranks | system | vs | grad+momentum MB/step | ratio | total ratio | eval loss | vs | diff | "
        "train loss diff (last 50) | step time |"
    )
    lines = [header, "|" + "---|" * 11]
    for r in rows:
        lines.append(
            f"| {r['world']} | {r['system']} | {r['baseline']} | {r['grad_MB_per_step']:.4f} "
            f"(vs {r['baseline_grad_MB_per_step']:.3f}) | 1/{1 / r['grad_ratio']:.1f} | {r['total_ratio']:.3f} | "
            f"{r['eval_loss']:.4f} | {r['baseline_eval_loss']:.4f} | {100 * r['loss_diff']:+.2f}% | "
            f"{100 * r['train_loss_diff']:+.2f}% | {r['time_ratio']:.2f} |"
        )
    for world, record in records.items():  # the same algorithm at two stages: how far rounding alone moves the loss
        a, b = record["adam-0"], record["adam-1"]
        lines.append(
            f"| {world} | adam-1 (noise floor) | adam-0 | | | | {b['eval_loss']:.4f} | {a['eval_loss']:.4f} | "
            f"{100 * (b['eval_loss'] / a['eval_loss'] - 1):+.2f}% | "
            f"{100 * (statistics.mean(b['loss'][-50:]) / statistics.mean(a['loss'][-50:]) - 1):+.2f}% | |"
        )
    table = "\n".join(lines)
    print(table)
    (out / "onebit.md").write_text(table + "\n")
    (out / "onebit.json").write_text(json.dumps(rows, indent=1))
    plot(records, out)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
