"""Muon against AdamW under ZeRO 0-3: step time and bytes each rank sends per step, the example GPT on 2 ranks.

    python benchmarks/muon.py [--n_embd 256] [--n_layer 4] [--steps 10] [--micro 4]

Both optimizers train the same model from the same seed on the same batches, taking turns step by step in one
process group. Muon's extra traffic is one all-gather of its flat groups' updates per step at stages 1-3 (none at
stage 0); its extra compute is Newton-Schulz on every matrix, on every rank that holds a piece of it. The example
GPT's names follow nanoGPT (``wte``, ``wpe``): DeepSpeed's rule (2-D and no ``embed`` / ``lm_head`` in the name)
puts its embeddings, and the tied head, in Muon's half, as it would under DeepSpeed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from zeroshard.testing import run_distributed
from zeroshard.testing.models import GPT, GPTConfig


def optimizer(kind: str) -> dict:
    if kind == "AdamW":
        return {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}
    return {"type": "Muon", "params": {"lr": 1e-3, "muon_lr": 2e-2, "momentum": 0.95, "weight_decay": 0.01,
                                       "ns_method": "standard"}}  # fmt: skip


def worker(cfg: GPTConfig, steps: int, micro: int) -> dict:
    import zeroshard

    rank = zeroshard.comm.get_rank()
    g = torch.Generator().manual_seed(rank)
    data = [torch.randint(0, cfg.vocab_size, (micro, cfg.block_size + 1), generator=g) for _ in range(steps + 2)]
    out = {}
    for stage in (0, 1, 2, 3):
        engines = {}
        for kind in ("AdamW", "Muon"):
            torch.manual_seed(0)
            config = {"train_micro_batch_size_per_gpu": micro, "steps_per_print": 10**9, "optimizer": optimizer(kind),
                      "zero_optimization": {"stage": stage}}  # fmt: skip
            engines[kind] = zeroshard.initialize(model=GPT(cfg), config=config)[0]
        times = {kind: [] for kind in engines}
        for step, batch in enumerate(data):
            for kind, engine in engines.items():
                if step == 2:
                    engine.comm_ledger.reset()  # steady state
                started = time.perf_counter()
                loss = engine(batch[:, :-1], batch[:, 1:])
                engine.backward(loss)
                engine.step()
                if step >= 2:
                    times[kind].append(time.perf_counter() - started)
        for kind, engine in engines.items():
            out[(stage, kind)] = {
                "step_s": statistics.median(times[kind]),
                "wire_per_step": engine.comm_ledger.total_wire_bytes() / steps,
                "loss": loss.item(),
            }
            engine.destroy()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n_embd", type=int, default=256)
    parser.add_argument("--n_layer", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--micro", type=int, default=4)
    args = parser.parse_args()
    cfg = GPTConfig(n_embd=args.n_embd, n_layer=args.n_layer, n_head=4, vocab_size=256, block_size=64)
    params = sum(p.numel() for p in GPT(cfg).parameters())
    out = run_distributed(worker, 2, cfg, args.steps, args.micro, timeout_s=1800)[0]
    print(f"example GPT {params / 1e6:.2f}M parameters, 2 Gloo ranks, micro-batch {args.micro} x 64 tokens")
    print(f"{'stage':<7}{'AdamW ms':>10}{'Muon ms':>10}{'time x':>8}{'AdamW MB':>10}{'Muon MB':>10}{'bytes x':>9}")
    for stage in (0, 1, 2, 3):
        a, m = out[(stage, "AdamW")], out[(stage, "Muon")]
        print(
            f"{stage:<7}{a['step_s'] * 1e3:>10.1f}{m['step_s'] * 1e3:>10.1f}{m['step_s'] / a['step_s']:>8.2f}"
            f"{a['wire_per_step'] / 2**20:>10.2f}{m['wire_per_step'] / 2**20:>10.2f}"
            f"{m['wire_per_step'] / a['wire_per_step'] if a['wire_per_step'] else float('nan'):>9.2f}"
        )


if __name__ == "__main__":
    main()
