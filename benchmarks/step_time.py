"""Step time of zeroshard stages 0-3 against torch DDP and FSDP2, same model, data and global batch, one run.

    python benchmarks/step_time.py [--world 2] [--n_layer 4] [--n_embd 256] [--steps 30] [--gradient_check]
    python benchmarks/step_time.py --n_layer 8 --n_embd 768 --vocab 16384 --seq 128 --micro 4 --steps 14 \
        --systems limit ddp zeroshard-1 zeroshard-2 zeroshard-3 [--dtype bf16]     # the 69.4M GPT

Each system trains the same GPT from the same seed on the same micro-batches; the systems take
turns step by step inside one process group, so machine noise hits all of them alike. Reports the
median step time and its ratio to DDP and to the compute-only limit (``limit``: each rank doing DDP's work with no
communication), the final loss (all systems must agree; the limit's is its own data's), bytes
communicated per step and, for zeroshard, the exposed wait (``engine.exposed_wait()``: the seconds the training
thread waited per kind of transfer) per step and its largest kinds. ``--gradient_check`` adds each stage with
``gradient_check`` on, checking every step and every 100th step (its overhead, against the same stage without it).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from zeroshard.testing import run_distributed
from zeroshard.testing.models import GPT, GPTConfig


def batches(cfg: GPTConfig, steps: int, micro: int, rank: int):
    gen = torch.Generator().manual_seed(1000 + rank)
    data = torch.randint(0, cfg.vocab_size, (steps, micro, cfg.block_size + 1), generator=gen)
    return [(d[:, :-1], d[:, 1:]) for d in data]


def torch_step(model, opt, autocast: torch.dtype | None = None):
    """One plain PyTorch training step (the baselines' loop); with ``autocast``, forward runs under
    ``torch.autocast`` in that dtype (torch's mixed precision: fp32 weights, low-precision compute)."""

    def step(x, y):
        with torch.autocast(x.device.type, dtype=autocast) if autocast else contextlib.nullcontext():
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def limit_system(cfg, lr, dtype: str = "fp32"):
    """The compute-only limit: DDP's per-rank work (the same model, micro-batch and fused AdamW) with no communication
    at all (each rank trains alone, so its loss is its own data's)."""
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    return torch_step(model, opt, torch.bfloat16 if dtype == "bf16" else None)


def ddp_system(cfg, lr, dtype: str = "fp32"):
    """DDP; in bf16 with torch's autocast (fp32 weights and gradients, bf16 matmuls)."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(GPT(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)

    return torch_step(model, opt, torch.bfloat16 if dtype == "bf16" else None)


def fsdp2_system(cfg, lr, dtype: str = "fp32"):
    """FSDP2 wrapping each block; in bf16 with its mixed-precision policy (bf16 gathered parameters and
    reductions, fp32 sharded parameters and optimizer)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = GPT(cfg)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if dtype == "bf16" else MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, foreach=True)

    return torch_step(model, opt)


def zeroshard_system(cfg, lr, stage, micro, extra_zero=None, dtype: str = "fp32", extra=None):
    import zeroshard

    torch.manual_seed(0)
    model = GPT(cfg)
    block = sum(p.numel() for p in model.blocks[0].parameters())
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": lr}},
        "zero_optimization": {
            "stage": stage,
            "overlap_comm": True,
            "reduce_bucket_size": 2_000_000,
            "gather_unit_classes": ["Block"],
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": block,  # one unit ahead, as FSDP2 prefetches
            **(extra_zero or {}),
        },
        "bf16": {"enabled": dtype == "bf16"},
        **(extra or {}),
    }
    engine, _, _, _ = zeroshard.initialize(model=model, config=config)
    return engine_step(engine)


def engine_step(engine):
    """One step of a DeepSpeed-style engine (zeroshard's or DeepSpeed's); the engine stays reachable."""

    def step(x, y):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss

    step.engine = engine
    return step


def take_turns(systems: dict, data: list, warmup: int, after_step=None) -> dict:
    """Systems take turns step by step, so machine noise hits all of them alike. ``after_step(name, step)``
    may add to a system's record right after its step (e.g. the bytes the ledger counted for it)."""
    import torch.distributed as dist

    results = {name: {"times": [], "loss": None} for name in systems}
    for i, (x, y) in enumerate(data):
        for name, step in systems.items():
            engine = getattr(step, "engine", None)
            if hasattr(engine, "comm_ledger"):
                engine.comm_ledger.reset()  # count this step's bytes only
            dist.barrier()
            started = time.perf_counter()
            loss = step(x, y)
            elapsed = time.perf_counter() - started
            if i >= warmup:
                results[name]["times"].append(elapsed)
            results[name]["loss"] = loss.item()
            if after_step is not None:
                results[name].update(after_step(name, step))
    return results


SYSTEMS = ["limit", "ddp", "fsdp2", "zeroshard-0", "zeroshard-1", "zeroshard-2", "zeroshard-3", "zeroshard-3-keep"]
KEEP = {"stage3_max_reuse_distance": 10**9}  # DeepSpeed's default: every block kept from its forward to its backward


def worker(cfg: GPTConfig, steps: int, micro: int, warmup: int, gradient_check=False, dtype="fp32", names=SYSTEMS):
    from zeroshard import comm

    data = batches(cfg, steps, micro, comm.get_rank())
    baselines = {"limit": limit_system, "ddp": ddp_system, "fsdp2": fsdp2_system}
    systems = {name: baselines[name](cfg, 1e-3, dtype) for name in names if name in baselines}
    for name in (name for name in names if name.startswith("zeroshard-")):
        stage, keep = int(name.split("-")[1]), name.endswith("-keep")
        systems[name] = zeroshard_system(cfg, 1e-3, stage, micro, KEEP if keep else None, dtype=dtype)
        for interval in (1, 100) if gradient_check and not keep else ():
            check = {"gradient_check": {"enabled": True, "interval": interval}}
            systems[f"zeroshard-{stage} check/{interval}"] = zeroshard_system(
                cfg, 1e-3, stage, micro, dtype=dtype, extra=check
            )

    exposed = {name: [] for name in systems}  # per step, the training thread's wait by kind (zeroshard's)

    def wire(name, step):
        if not name.startswith("zeroshard"):
            return {"bytes": None}
        exposed[name].append(step.engine.exposed_wait())  # this step's: take_turns reset the ledger before it
        return {"bytes": step.engine.comm_ledger.total_wire_bytes()}

    results = take_turns(systems, data, warmup, wire)
    for name, waits in exposed.items():
        results[name]["exposed"] = waits[warmup:]
    return results


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--n_layer", type=int, default=4)
    parser.add_argument("--n_embd", type=int, default=256)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--gradient_check", action="store_true", help="add each stage with gradient_check on")
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=SYSTEMS, help="limit and ddp always run")
    args = parser.parse_args()
    heads = 8 if args.n_embd >= 512 else 4
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.n_layer, n_head=heads, n_embd=args.n_embd)
    params = sum(p.numel() for p in GPT(cfg).parameters())
    names = ["limit", "ddp", *(n for n in args.systems if n not in ("limit", "ddp"))]
    results = run_distributed(
        worker, args.world, cfg, args.steps, args.micro, args.warmup, args.gradient_check, args.dtype, names,
        timeout_s=3600,
    )[0]  # fmt: skip
    base, limit = statistics.median(results["ddp"]["times"]), statistics.median(results["limit"]["times"])
    print(
        f"GPT {params / 1e6:.2f}M params, {args.world} Gloo ranks, {args.dtype}, "
        f"micro-batch {args.micro} x {cfg.block_size} tokens"
    )
    print("| system | median step (ms) | ratio to DDP | ratio to the limit | final loss | wire MB/step/rank | "
          "exposed wait ms/step (share of the step) | largest waits ms/step |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        med = statistics.median(r["times"])
        mb = f"{r['bytes'] / 1e6:.2f}" if r["bytes"] is not None else "-"
        waits, largest = "-", "-"
        if r.get("exposed"):
            total = statistics.median(sum(w.values()) for w in r["exposed"])
            kinds = {k for w in r["exposed"] for k in w}
            per_kind = {k: statistics.median(w.get(k, 0.0) for w in r["exposed"]) for k in kinds}
            waits = f"{total * 1e3:.1f} ({total / med:.0%})"
            largest = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in sorted(per_kind.items(), key=lambda i: -i[1])[:3])
        loss = f"{r['loss']:.4f}" + (" (own data)" if name == "limit" else "")
        print(f"| {name} | {med * 1e3:.1f} | {med / base:.3f} | {med / limit:.3f} | {loss} | {mb} | {waits} | "
              f"{largest} |")  # fmt: skip


if __name__ == "__main__":
    main()
