"""Tensor, sequence and expert parallelism against their compute-only limit, in one run (issue 56).

    python benchmarks/axes.py [--axes tp2 sp2 ep2] [--stage 3] [--steps 12] [--warmup 3]

Per axis, two engines built alike from the same seed on 2 Gloo ranks: one trains, the other takes the same steps
inside ``zeroshard.testing.compute_only`` (no collective leaves the rank: the step's own work and memory traffic
without its communication; its results are not the real ones). All of them take turns step by step in one process
group, so machine noise hits them alike.

- ``tp2``: the example GPT with ``tensor_parallel.autotp_size 2`` (``benchmarks/tp_training.py``'s layer specs):
  both ranks take the whole batch, each computes half of every split layer.
- ``sp2``: a Hugging Face Llama with Ulysses (``register_with_transformers``, ``sequence_parallel_size 2``): each
  rank takes half of every sequence.
- ``ep2``: a Hugging Face Mixtral with ``expert_parallel.autoep_size 2`` (``benchmarks/moe.py``'s model): each rank
  holds half of the experts; the rest of the model is data-parallel over both ranks.

The analytic communication time of a step: for each collective the engine's ledger counted in it (the tests hold the
ledger to the analytic counts from the model's shapes: ``tests/distributed/test_{tensor_parallel,sequence_parallel,
moe}.py``), the link's latency per call plus its bytes on the wire over the link's bandwidth, both measured per kind
of collective by probes in the same process group (a 1-element and a 4 Mi-element fp32 collective, before and after
the steps). Goal: step - limit <= that time; the exposed wait (``engine.exposed_wait()``) says how much of it the
training thread waited.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe  # noqa: E402
import tp_training  # noqa: E402

from zeroshard.testing import run_distributed  # noqa: E402
from zeroshard.testing.models import GPT, GPTConfig  # noqa: E402

PROBED = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
VOCAB = 512


def probe_link(world, reps: int = 8) -> dict[str, tuple[float, float]]:
    """Per kind of collective on ``world``: (seconds per call, seconds per wire byte), from the median time of a
    1-element and a 4 Mi-element fp32 call (the wire bytes as the ledger counts them)."""
    from zeroshard import comm
    from zeroshard.comm.collectives import all_to_all

    def timed(op: str, numel: int) -> tuple[float, float]:
        n = world.size
        data, out = torch.ones(n * numel), torch.empty(n * numel)
        calls = {
            "all_reduce": lambda: comm.all_reduce(data, world),
            "all_gather": lambda: comm.all_gather(out, data[:numel], world),
            "reduce_scatter": lambda: comm.reduce_scatter(out[:numel], data, world),
            "all_to_all": lambda: all_to_all(out, data, world),
        }
        times = []
        for _ in range(reps):
            comm.barrier(world)
            started = time.perf_counter()
            calls[op]()
            times.append(time.perf_counter() - started)
        wire = {"all_reduce": 2 * (n - 1) / n * n * numel * 4}.get(op, (n - 1) / n * n * numel * 4)
        return statistics.median(times), wire

    link = {}
    for op in PROBED:
        latency, _ = timed(op, 1)
        seconds, wire = timed(op, 1 << 20)
        link[op] = (latency, max(seconds - latency, 1e-9) / wire)
    return link


def probe_overlap(world, reps: int = 15) -> dict[str, float]:
    """Whether a transfer hides behind compute on this machine: the median seconds of a matmul loop alone, of a
    16 MiB all-gather alone, and of both at once (the gather issued, the loop run, the gather waited for); hidden =
    (alone + alone - both) / gather alone: 1 when the gather costs nothing beside compute, 0 when they run in turn."""
    from zeroshard import comm

    a = torch.randn(384, 384)
    data, out = torch.ones(world.size * (1 << 21)), torch.empty(world.size * (1 << 21))

    def compute():
        for _ in range(60):
            a @ a

    def both():
        pending = comm.all_gather(out, data[: 1 << 21], world, async_op=True)
        compute()
        pending.wait()

    runs = {"compute": compute, "gather": lambda: comm.all_gather(out, data[: 1 << 21], world), "both": both}
    times = {name: [] for name in runs}
    for _ in range(reps):  # in turns, so machine noise hits the three alike
        for name, run in runs.items():
            comm.barrier(world)
            started = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - started)
    medians = {name: statistics.median(t) for name, t in times.items()}
    hidden = (medians["compute"] + medians["gather"] - medians["both"]) / medians["gather"]
    return {**medians, "hidden": hidden}


def analytic_seconds(ledger: dict, link: dict) -> float:
    """Latency per call plus wire bytes over bandwidth, per (op, group) the ledger counted; collectives the probes
    did not time (broadcasts, compressed ones) are priced as all-reduces."""
    total = 0.0
    for (op, _group), counts in ledger.items():
        latency, per_byte = link.get(op.split("_1bit")[0].split("_int8")[0], link["all_reduce"])
        total += counts.calls * latency + counts.wire_bytes * per_byte
    return total


def tp_pair(args, rank: int):
    import zeroshard

    cfg = GPTConfig(vocab_size=VOCAB, block_size=args.seq, n_layer=args.layers, n_head=8, n_embd=args.hidden)
    gen = torch.Generator().manual_seed(1000)  # every tensor rank the same batch
    data = torch.randint(0, VOCAB, (args.steps, args.micro, args.seq + 1), generator=gen)

    def build():
        torch.manual_seed(0)
        config = tp_training.config(2, args.micro, args.stage, tp_training.LAYER_SPECS)
        return zeroshard.initialize(model=GPT(cfg), config=config)[0]

    def step(engine, i):
        return engine(data[i, :, :-1], data[i, :, 1:])

    return build, step


def sp_pair(args, rank: int):
    import transformers

    import zeroshard
    from zeroshard.sequence_parallel import register_with_transformers, shift_labels, token_weighted_loss

    def model():
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=args.hidden,
            intermediate_size=2 * args.hidden,
            num_hidden_layers=args.layers,
            num_attention_heads=8,
            num_key_value_heads=4,
            attn_implementation="sdpa",
        )
        return transformers.LlamaForCausalLM(config)

    mpu = register_with_transformers(model(), "sdpa", 2, micro_batch_size=1)  # sdpa now runs Ulysses
    tokens = 2 * args.seq * args.micro  # one sequence a step, half of it on each rank
    gen = torch.Generator().manual_seed(1000)
    ids = torch.randint(0, VOCAB, (args.steps, 1, tokens), generator=gen)
    piece = slice(mpu.sequence.rank * tokens // 2, (mpu.sequence.rank + 1) * tokens // 2)
    positions = torch.arange(tokens)[None, piece]

    def build():
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": args.stage},
        }
        return zeroshard.initialize(model=model(), config=config, mpu=mpu)[0]

    def step(engine, i):
        labels = shift_labels(ids[i])[:, piece]
        loss = engine(input_ids=ids[i][:, piece], position_ids=positions, shift_labels=labels, labels=labels).loss
        return token_weighted_loss(loss, labels, mpu.sequence)

    return build, step


def ep_pair(args, rank: int):
    # eager attention: sdpa is Ulysses' once sp2 registered it
    settings = SimpleNamespace(**{**vars(args), "experts": 4, "attn_implementation": "eager"})
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own micro-batches (the dense part is DP=2)
    data = torch.randint(0, VOCAB, (args.steps, args.micro, args.seq), generator=gen)

    def step(engine, i):
        return engine(input_ids=data[i], labels=data[i]).loss

    return (lambda: moe.system(settings, 2)), step


PAIRS = {"tp2": tp_pair, "sp2": sp_pair, "ep2": ep_pair}


def worker(args) -> dict:
    from zeroshard import comm
    from zeroshard.testing import compute_only

    world = comm.group_of(None, "world")
    overlap = probe_overlap(world)
    link_before = probe_link(world)
    rows, steps = {}, {}
    for axis in args.axes:
        build, step = PAIRS[axis](args, comm.get_rank())
        rows[axis], rows[f"{axis} limit"] = build(), build()
        steps[axis] = steps[f"{axis} limit"] = step
    record = {name: {"times": [], "waits": [], "ledgers": []} for name in rows}
    for i in range(args.steps):
        for name, engine in rows.items():
            engine.comm_ledger.reset()
            comm.barrier(world)
            started = time.perf_counter()
            with compute_only() if name.endswith("limit") else contextlib.nullcontext():
                engine.backward(steps[name](engine, i))
                engine.step()
            elapsed = time.perf_counter() - started
            if i >= args.warmup:
                record[name]["times"].append(elapsed)
                record[name]["waits"].append(sum(engine.exposed_wait().values()))
                record[name]["ledgers"].append(engine.comm_ledger.summary())
    link_after = probe_link(world)
    link = {op: tuple(statistics.mean(v) for v in zip(link_before[op], link_after[op])) for op in PROBED}
    for r in record.values():
        r["analytic"] = statistics.median(analytic_seconds(ledger, link) for ledger in r["ledgers"])
        r["ledger"] = {f"{op}/{g}": (t.calls, t.wire_bytes) for (op, g), t in r.pop("ledgers")[-1].items()}
    return {"rows": record, "link": link, "overlap": overlap}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--axes", nargs="*", choices=list(PAIRS), default=list(PAIRS))
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    result = run_distributed(worker, 2, args, timeout_s=3600, env={"DS_ACCELERATOR": "cpu"})[0]
    link = ", ".join(f"{op} {lat * 1e6:.0f} us + {1 / per_byte / 1e9:.2f} GB/s" for op, (lat, per_byte) in
                     result["link"].items())  # fmt: skip
    print(f"2 Gloo ranks, ZeRO stage {args.stage}; link (measured): {link}")
    o = result["overlap"]
    print(f"overlap: compute {o['compute'] * 1e3:.1f} ms, 16 MiB all-gather {o['gather'] * 1e3:.1f} ms, both at once "
          f"{o['both'] * 1e3:.1f} ms: {o['hidden']:.0%} of the gather hidden")  # fmt: skip
    print("| axis | median step (ms) | compute-only limit (ms) | step - limit (ms) | analytic comm (ms) | "
          "exposed wait (ms) | goal: step - limit <= analytic | wire per step |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    rows = result["rows"]
    for axis in args.axes:
        r, limit = rows[axis], rows[f"{axis} limit"]
        step, floor = statistics.median(r["times"]), statistics.median(limit["times"])
        wire = ", ".join(f"{k} {calls} x / {w / 1e6:.2f} MB" for k, (calls, w) in sorted(r["ledger"].items()))
        print(f"| {axis} | {step * 1e3:.1f} | {floor * 1e3:.1f} | {(step - floor) * 1e3:.1f} | "
              f"{r['analytic'] * 1e3:.1f} | {statistics.median(r['waits']) * 1e3:.1f} | "
              f"{'met' if step - floor <= r['analytic'] else 'missed'} | {wire} |")  # fmt: skip


if __name__ == "__main__":
    main()
