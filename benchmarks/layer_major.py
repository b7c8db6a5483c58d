"""Gradient accumulation at ZeRO-3, micro-batch by micro-batch against layer-major (``zero_optimization.layer_major``,
``engine.train_batch``), measured as a user starts the run: ``zeroshard --num_gpus 2 <this file> --worker ...``.

    python benchmarks/layer_major.py [--width 768] [--layers 8] [--gas 1 8]      # the 69.4M GPT
    python benchmarks/layer_major.py --width 1024 --layers 16 --vocab 8192 --seq 64 --offload nvme   # 210M on NVMe
    python benchmarks/layer_major.py --gas 8 --reuse_distance 1000000000   # each unit gathered once per step in all

Per run (one engine per rank, fp32, AdamW, micro-batches of one sequence, ``train_batch`` for every step): the median
step time (the steps after the first), the bytes all-gathered per step and rank (the ledger), the bytes read from disk
per step and rank (``engine.disk_io()`` and the process's own ``/proc/self/io`` read count), and without offload the
compute-only limit: the same engine's step inside ``zeroshard.testing.compute_only()`` (nothing communicated), taken
in turns with the real steps so that the machine's drift hits both; and the wire time of the step's collectives at
the link's speed measured in the same process group (``benchmarks/axes.py``'s probes: latency per call plus wire
bytes over bandwidth). On a machine whose transfers cannot hide behind compute (2 cores, one per rank: a Gloo
transfer is CPU work), limit + wire is the step's physical floor.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import axes  # noqa: E402

from zeroshard.testing.models import GPT, GPTConfig  # noqa: E402


def config(gas: int, layer_major: bool, offload: str, nvme_path: str, reuse_distance: int = 0) -> dict:
    zero: dict = {
        "stage": 3,
        "gather_unit_classes": ["Block"],
        "stage3_param_persistence_threshold": 0,
        "stage3_max_reuse_distance": reuse_distance,
        "layer_major": layer_major,
    }
    if offload == "nvme":
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path}
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme_path, "max_in_cpu": 0}
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": zero,
        "steps_per_print": 1_000_000,
    }


def _disk_reads() -> int:
    """Bytes this process caused to be read from storage (``/proc/self/io`` ``read_bytes``; 0 where unavailable)."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))
    except (OSError, StopIteration):
        return 0


def worker(args) -> None:
    import zeroshard
    from zeroshard import comm
    from zeroshard.testing import compute_only

    heads = 12 if args.width % 12 == 0 else 16
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=heads, n_embd=args.width)
    ds_config = config(args.gas, args.layer_major == "on", args.offload, args.nvme_path, args.reuse_distance)
    torch.manual_seed(0)
    engine, *_ = zeroshard.initialize(model=GPT(cfg), config=ds_config)
    rank = comm.get_rank()
    generator = torch.Generator().manual_seed(rank)
    data = torch.randint(0, args.vocab, (args.steps * args.gas, 1, args.seq), generator=generator)
    batches = iter([(x, x) for x in data])
    engine.train_batch(batches)  # the first step makes the optimizer state: not timed
    comm.barrier(engine.mesh.world)
    engine.disk_io()  # a step running behind the forward is done
    engine.comm_ledger.reset()
    disk_before, io_before = engine.disk_io()["read"], _disk_reads()
    timed = args.steps - 1
    steps, limits, compute_data = [], [], iter([(x, x) for x in data[: timed * args.gas]])
    for _ in range(timed):  # the step, then (without offload) its compute-only limit: in turns, so drift hits both
        comm.barrier(engine.mesh.world)
        started = time.perf_counter()
        engine.train_batch(batches)
        steps.append(time.perf_counter() - started)
        if args.offload == "none":
            with compute_only():  # its collectives stay on the rank, uncounted
                started = time.perf_counter()
                engine.train_batch(compute_data)
                limits.append(time.perf_counter() - started)
    disk = engine.disk_io()["read"] - disk_before
    summary = engine.comm_ledger.summary()
    gathered = sum(t.bytes for (op, _), t in summary.items() if op == "all_gather")
    result = {
        "params": sum(p.numel() for p in GPT(cfg).parameters()),
        "step_s": statistics.median(steps),
        "gathered_per_step": gathered / timed,
        "disk_read_per_step": disk / timed,
        "proc_read_per_step": (_disk_reads() - io_before) / timed,
    }
    if limits:  # the compute-only limit of this layout, and the step's wire time at the link's measured speed
        result["limit_s"] = statistics.median(limits)
        result["wire_s"] = axes.analytic_seconds(summary, axes.probe_link(engine.mesh.world)) / timed
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def launch(args, gas: int, layer_major: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    with tempfile.TemporaryDirectory() as out:
        command = [
            sys.executable, "-m", "zeroshard", "--num_gpus", "2", os.path.abspath(__file__), "--worker",
            "--gas", str(gas), "--layer_major", layer_major, "--offload", args.offload, "--width", str(args.width),
            "--layers", str(args.layers), "--steps", str(args.steps), "--nvme_path", args.nvme_path, "--out", out,
            "--vocab", str(args.vocab), "--seq", str(args.seq), "--reuse_distance", str(args.reuse_distance),
        ]  # fmt: skip
        subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
        ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]
    result = dict(ranks[0])
    result["step_s"] = max(r["step_s"] for r in ranks)
    if "limit_s" in ranks[0]:
        result["limit_s"] = max(r["limit_s"] for r in ranks)
        result["wire_s"] = max(r["wire_s"] for r in ranks)
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--gas", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--offload", choices=["none", "nvme"], default="none")
    parser.add_argument("--nvme_path", default="/tmp")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--reuse_distance", type=int, default=0, help="stage3_max_reuse_distance (1e9: every unit "
                        "kept from its forward to its backward, gathered once per step in all)")  # fmt: skip
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layer_major", choices=["on", "off"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.gas = args.gas[0]
        return worker(args)
    print(f"2 ranks (zeroshard --num_gpus 2), stage 3, fp32, width {args.width}, {args.layers} blocks, offload "
          f"{args.offload}, vocabulary {args.vocab}, micro-batch 1 x {args.seq} tokens, stage3_max_reuse_distance "
          f"{args.reuse_distance}\n")  # fmt: skip
    print("| schedule | GAS | parameters | step s | compute-only limit s | step / limit | wire s at the link's speed | "
          "step / (limit + wire) | all-gathered MB per step and rank | disk read MB per step and rank (ledger / "
          "process) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for gas in args.gas:
        for layer_major in ("off", "on") if gas > 1 else ("off",):
            r = launch(args, gas, layer_major)
            limit, wire = r.get("limit_s"), r.get("wire_s")
            limits = (
                f"{limit:.3f} | {r['step_s'] / limit:.3f} | {wire:.3f} | {r['step_s'] / (limit + wire):.3f}"
                if limit
                else "- | - | - | -"
            )
            schedule = "layer-major" if layer_major == "on" else "micro-batch loop"
            print(
                f"| {schedule} | {gas} | {r['params'] / 1e6:.1f}M | {r['step_s']:.3f} | {limits} | "
                f"{r['gathered_per_step'] / 1e6:.1f} | {r['disk_read_per_step'] / 1e6:.1f} / "
                f"{r['proc_read_per_step'] / 1e6:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
