"""Tensor-parallel training against data parallelism on the same ranks: TP=2 x DP=1 vs DP=2, the example GPT.

    python benchmarks/tp_training.py [--sizes 256 768] [--n_layer 4] [--steps 12] [--micro 4] [--stage 1]

Both systems train the same model from the same seed on the same global batches (DP=2: each rank half of a batch;
TP=2: both ranks the whole batch, each computing half of every layer), taking turns step by step in one process
group so machine noise hits both alike. The example GPT's layers are placed with ``partition_config.layer_specs``
(its names are not a known family's): ``qkv`` column-parallel with q, k, v fused, ``proj`` and ``fc_out`` row, ``fc``
column, the rest (embeddings, norms, the LM head) replicated. Per system: median step time, bytes each rank sends
per step (the engine's ledger), model-state bytes per rank, and activation bytes autograd saves in one forward
(counted with saved-tensor hooks), final loss. DeepSpeed's AutoTP on the same model and specs joins the turns when
DeepSpeed is installed (its bytes and model state are not counted by zeroshard's ledger: "-").

TP trades communication for memory: every layer all-reduces an activation twice a step (forward after each row
layer, backward before each column layer), where DP moves the gradients once; in exchange a rank holds half of
every split weight, its gradient and optimizer state, and half of the attention and MLP activations.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time

import torch

from zeroshard.testing import run_distributed
from zeroshard.testing.models import GPT, GPTConfig

ENV = {"DS_ACCELERATOR": "cpu"}  # DeepSpeed on CPU ranks (Gloo), when it is installed

LAYER_SPECS = [
    {"patterns": [r".*\.qkv$"], "partition_type": "column", "shape": [3, -1], "partition_dim": 0},
    {"patterns": [r".*\.fc$"], "partition_type": "column"},
    {"patterns": [r".*\.(proj|fc_out)$"], "partition_type": "row"},
]
DS_SPECS = [
    {**spec, "patterns": [p.removesuffix("$") + r"\.weight$" for p in spec["patterns"]]} for spec in LAYER_SPECS
]


def config(tp: int, micro: int, stage: int, specs: list[dict]) -> dict:
    """The same config for both frameworks; only the layers the specs name split, the rest stays replicated."""
    return {
        "train_micro_batch_size_per_gpu": micro,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 2_000_000},
        "tensor_parallel": {"autotp_size": tp, "partition_config": {"use_default_specs": False, "layer_specs": specs}},
    }


def system(cfg: GPTConfig, tp: int, micro: int, stage: int):
    import zeroshard

    torch.manual_seed(0)
    engine, *_ = zeroshard.initialize(model=GPT(cfg), config=config(tp, micro, stage, LAYER_SPECS))
    return engine


def deepspeed_system(cfg: GPTConfig, micro: int, stage: int):
    """DeepSpeed's AutoTP on the same model and layer specs (DeepSpeed >= 0.18 on CPU: DS_ACCELERATOR=cpu, Gloo). Its
    AutoTP does not change the blocks' head count, so it is halved here, as zeroshard's placement does."""
    import deepspeed

    torch.manual_seed(0)
    model = GPT(cfg)
    for block in model.blocks:
        block.n_head //= 2
    settings = config(2, micro, stage, DS_SPECS)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=settings)
    return engine


def saved_activation_bytes(engine, x, y) -> int:
    """Bytes of the tensors autograd saves for backward in one forward (parameters excluded)."""
    params = {p.data_ptr() for p in engine.module.parameters()}
    total = 0

    def pack(t: torch.Tensor):
        nonlocal total
        if t.data_ptr() not in params:
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = engine(x, y)
    engine.backward(loss)
    engine.zero_grad()
    return total


def worker(cfg: GPTConfig, steps: int, micro: int, stage: int, warmup: int, with_deepspeed: bool) -> dict:
    import torch.distributed as dist

    from zeroshard import comm

    rank = comm.get_rank()
    g = torch.Generator().manual_seed(1000)
    data = torch.randint(0, cfg.vocab_size, (steps, 2 * micro, cfg.block_size + 1), generator=g)
    engines = {"DP=2": system(cfg, 1, micro, stage), "TP=2 x DP=1": system(cfg, 2, 2 * micro, stage)}
    batches = {  # DP=2: this rank's half of each global batch; TP=2: the whole batch on both ranks
        "DP=2": [d[rank * micro : (rank + 1) * micro] for d in data],
        "TP=2 x DP=1": list(data),
    }
    if with_deepspeed:
        engines["DeepSpeed AutoTP=2"] = deepspeed_system(cfg, 2 * micro, stage)
        batches["DeepSpeed AutoTP=2"] = list(data)
    out = {}
    for name, engine in engines.items():
        first = batches[name][0]
        out[name] = {
            "times": [],
            "activations": saved_activation_bytes(engine, first[:, :-1], first[:, 1:]),
            "model_state": sum(engine.state_bytes().values()) if hasattr(engine, "state_bytes") else None,
            "wire": None,
        }
    for step in range(steps):
        for name, engine in engines.items():
            batch = batches[name][step]
            ledger = getattr(engine, "comm_ledger", None)
            if ledger is not None:
                ledger.reset()
            dist.barrier()
            started = time.perf_counter()
            loss = engine(batch[:, :-1], batch[:, 1:])
            engine.backward(loss)
            engine.step()
            elapsed = time.perf_counter() - started
            if step >= warmup:
                out[name]["times"].append(elapsed)
            if ledger is not None:
                out[name]["wire"] = ledger.total_wire_bytes()
            loss_value = loss.detach().clone()
            if name == "DP=2":  # the global batch's loss: the mean of the two halves'
                dist.all_reduce(loss_value)
                loss_value /= 2
            out[name]["loss"] = loss_value.item()
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 768], help="model widths (n_embd)")
    parser.add_argument("--n_layer", type=int, default=4)
    parser.add_argument("--micro", type=int, default=4, help="sequences per data-parallel rank per step")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--stage", type=int, default=1)
    parser.add_argument("--no_deepspeed", action="store_true", help="leave DeepSpeed's AutoTP out")
    args = parser.parse_args()
    with_deepspeed = not args.no_deepspeed and importlib.util.find_spec("deepspeed") is not None
    print(f"2 Gloo ranks, ZeRO stage {args.stage}, global batch {2 * args.micro} x 64 tokens, {args.n_layer} layers")
    columns = "median step (ms) | wire MB/step/rank | model state MB/rank | activations MB/rank | loss"
    print(f"| model | system | {columns} |")
    print("|---|---|---|---|---|---|---|")
    for width in args.sizes:
        cfg = GPTConfig(vocab_size=512, block_size=64, n_layer=args.n_layer, n_head=8, n_embd=width)
        params = sum(p.numel() for p in GPT(cfg).parameters())
        results = run_distributed(
            worker, 2, cfg, args.steps, args.micro, args.stage, args.warmup, with_deepspeed, timeout_s=3600, env=ENV
        )[0]
        for name, r in results.items():
            wire = f"{r['wire'] / 1e6:.2f}" if r["wire"] is not None else "-"
            state = f"{r['model_state'] / 2**20:.1f}" if r["model_state"] is not None else "-"
            print(
                f"| {params / 1e6:.1f}M | {name} | {statistics.median(r['times']) * 1e3:.1f} | {wire} | {state} | "
                f"{r['activations'] / 2**20:.1f} | {r['loss']:.4f} |"
            )


if __name__ == "__main__":
    main()
