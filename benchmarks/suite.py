"""Side by side: torch DDP, torch FSDP2, DeepSpeed ZeRO-1/2/3 and zeroshard stages 0-3 (+ CPU offload) on
the same GPT, data, seed and global batch; one command, a markdown report with PNG plots.

    python benchmarks/suite.py [--runs small:2 medium:2 large:2 small:4 medium:4] [--steps 12]

Per run (model size x ranks): median step time, tokens/s, ratio to DDP, loss after the last step
(every system must agree: one that trains differently is not comparable), bytes communicated per
step against the analytic value (zeroshard, where the ledger counts them), peak RSS per rank and
model-state bytes against the analytic ZeRO value. When ten copies of the model state fit in half of
this machine's memory the systems are built in one process group and take turns step by step (machine
noise hits all alike), and memory is measured with each system alone in fresh processes; larger runs
time each system alone. DeepSpeed is optional (``pip install deepspeed``; it runs on Gloo with
``DS_ACCELERATOR=cpu``); it is skipped with a message if it cannot be imported. Plots need matplotlib
(skipped with a message otherwise).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_time import (  # noqa: E402
    batches,
    ddp_system,
    engine_step,
    fsdp2_system,
    take_turns,
    zeroshard_system,
)

from zeroshard.accelerator import host_peak_rss  # noqa: E402
from zeroshard.testing import run_distributed  # noqa: E402
from zeroshard.testing.models import GPT, GPTConfig  # noqa: E402

SIZES = {  # name -> (layers, width, vocabulary)
    "small": (4, 256, 512),
    "medium": (6, 512, 8192),
    "large": (12, 768, 8192),
}
DEFAULT_RUNS = ["small:2", "medium:2", "large:2", "small:4", "medium:4"]
# relative: fp32 systems differ only in reduction order; bf16 systems also round differently (autocast keeps
# fp32 weights, zeroshard and DeepSpeed bf16 weights with fp32 masters)
LOSS_TOLERANCE = {"fp32": 1e-3, "bf16": 2e-2}
ENV = {"DS_ACCELERATOR": "cpu"}


def have_deepspeed() -> bool:
    try:
        import deepspeed  # noqa: F401
    except Exception as err:  # any import failure means "skip it"
        print(f"DeepSpeed skipped: cannot import it ({type(err).__name__}: {err}); pip install deepspeed")
        return False
    return True


def deepspeed_system(cfg: GPTConfig, lr: float, stage: int, micro: int, dtype: str):
    import deepspeed

    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage, "overlap_comm": True, "reduce_bucket_size": 2_000_000},
        "bf16": {"enabled": dtype == "bf16"},
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return engine_step(engine)


def build(name: str, cfg: GPTConfig, micro: int, dtype: str):
    lr = 1e-3
    if name == "ddp":
        return ddp_system(cfg, lr, dtype)
    if name == "fsdp2":
        return fsdp2_system(cfg, lr, dtype)
    kind, _, rest = name.partition("-")
    if kind == "deepspeed":
        return deepspeed_system(cfg, lr, int(rest), micro, dtype)
    stage, _, offload = rest.partition("-")
    extra = {"offload_optimizer": {"device": "cpu"}} if offload == "offload" else {}
    return zeroshard_system(cfg, lr, int(stage), micro, extra, dtype)


def analytic_model_state(name: str, params: int, world: int) -> float:
    """The ZeRO paper's model-state bytes per rank for Adam, 16 per parameter: fp32, 4 (weights) + 4 (gradients)
    + 8 (Adam); mixed precision, 2 + 2 + 12 (fp32 master weights and Adam). Stages 1 and 2 shard the last two
    and the last one of these terms, stage 3 all."""
    stage = {"ddp": 0, "fsdp2": 3}.get(name)
    if stage is None:
        stage = int(name.split("-")[1])
    return {0: 16 * params, 1: 8 * params + 8 * params / world, 2: 4 * params + 12 * params / world}.get(
        stage, 16 * params / world
    )


def timing_worker(cfg: GPTConfig, names: list[str], steps: int, micro: int, warmup: int, dtype: str) -> dict:
    """Every system in one process group, taking turns step by step."""
    from zeroshard import comm

    data = batches(cfg, steps, micro, comm.get_rank())
    systems = {name: build(name, cfg, micro, dtype) for name in names}
    return take_turns(systems, data, warmup, wire_bytes)


def alone_worker(cfg: GPTConfig, name: str, micro: int, steps: int, warmup: int, dtype: str) -> dict:
    """One system in fresh processes: its timing (when ``steps`` allows), peak RSS and model-state bytes."""
    from zeroshard import comm

    before = host_peak_rss()
    step = build(name, cfg, micro, dtype)
    result = take_turns({name: step}, batches(cfg, steps, micro, comm.get_rank()), warmup, wire_bytes)[name]
    peak = host_peak_rss()
    state = None
    if name.startswith("zeroshard"):
        b = step.engine.state_bytes()
        aliased = step.engine.stack.optimizer_state.master_bytes_shared_with_params()  # fp32: master = params
        state = b["params"] + b["grad_shard"] + b["optimizer_state"] + b["master"] - aliased
    return {**result, "peak_rss": peak, "rss_growth": peak - before, "model_state": state}


def wire_bytes(name: str, step) -> dict:
    """Bytes the ledger counted for a zeroshard step, and the analytic value (other systems: not counted)."""
    from zeroshard import comm

    if not name.startswith("zeroshard"):
        return {"wire": None, "analytic_wire": None}
    ledger = step.engine.comm_ledger
    return {"wire": ledger.total_wire_bytes(), "analytic_wire": analytic_wire(step.engine, comm.get_world_size())}


def whole_numel(param) -> int:
    """A parameter's element count (under stage 3 its data is this rank's shard or nothing: ``ds_numel``)."""
    return getattr(param, "ds_numel", None) or param.numel()


def analytic_wire(engine, world: int) -> float:
    """Ring bytes per rank per step from the model's shapes (not the engine's plan): 2P (stages 0-2; reduce-scatter +
    all-gather or one all-reduce), and for stage 3 every unit gathered twice (forward, backward) except the root (the
    parameters outside ``model.blocks``, whose units are the blocks), which stays gathered, and the last block, kept
    from its forward into its backward once the first step has recorded the order, plus one reduce-scatter of
    everything; plus the 4-byte gradient-norm all-reduce of the sharded stages. Gathers move the compute dtype,
    reductions the reduce dtype (``communication_data_type``). Padding (under ``world`` elements per flat group) is
    left out, so the ledger may exceed it by that."""
    share = (world - 1) / world
    model = engine.module
    numel = sum(whole_numel(p) for p in model.parameters() if p.requires_grad)
    gathered, reduced = numel * engine.policy.compute.itemsize, numel * engine.policy.reduce.itemsize
    if engine.zero_optimization_stage() == 0:
        return 2 * share * reduced
    norm = 2 * share * 4
    if engine.zero_optimization_stage() < 3:
        return share * (reduced + gathered) + norm
    in_blocks = sum(whole_numel(p) for p in model.blocks.parameters() if p.requires_grad)
    in_last = sum(whole_numel(p) for p in model.blocks[-1].parameters() if p.requires_grad)
    root, last = (numel - in_blocks) * engine.policy.compute.itemsize, in_last * engine.policy.compute.itemsize
    return share * (2 * gathered - root - last + reduced) + norm


def gpt_config(size: str) -> GPTConfig:
    layers, width, vocab = SIZES[size]
    return GPTConfig(vocab_size=vocab, block_size=64, n_layer=layers, n_head=8 if width >= 512 else 4, n_embd=width)


def fits_interleaved(params: int, world: int, systems: int) -> bool:
    """Interleaving holds every system's model state (up to 16 B/param per rank, ~1.5x with activations and
    buffers) at once; use it only while that stays under half of this machine's memory."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return systems * 16 * params * world * 1.5 < 0.5 * memory


def run_size(
    size: str,
    world: int,
    steps: int,
    micro: int,
    warmup: int,
    names: list[str],
    alone=None,
    dtype: str = "fp32",
    fresh: bool = True,
) -> dict:
    """One model size on ``world`` ranks: interleaved timing when every system fits in memory at once
    (``alone=None`` decides; True/False forces), else each system timed alone in fresh processes. Each system's
    memory is measured alone, in fresh interpreters as launched ranks start (``fresh=False``: forked from the test
    harness's preloaded server, whose peak RSS is not a launched rank's; the smoke test reads no RSS)."""
    cfg = gpt_config(size)
    params = sum(p.numel() for p in GPT(cfg).parameters())
    alone = not fits_interleaved(params, world, len(names)) if alone is None else alone
    timing = None
    if not alone:
        timing = run_distributed(
            timing_worker, world, cfg, names, steps, micro, warmup, dtype, timeout_s=7200, env=ENV
        )[0]
    by_system = {}  # each system alone: its memory, and its timing when not interleaved
    for name in tqdm(names, desc=f"{size} x {world} ranks, {dtype}", unit="system", leave=False):
        measure = (steps, warmup) if alone else (2, 0)
        by_system[name] = run_distributed(  # a peak RSS is a whole process's: fresh interpreters, as launched
            alone_worker, world, cfg, name, micro, *measure, dtype, timeout_s=7200, env=ENV, fresh_interpreters=fresh
        )[0]
    return {
        "dtype": dtype,
        "params": params,
        "cfg": cfg,
        "world": world,
        "alone": alone,
        "timing": by_system if alone else timing,
        "memory": by_system,
        "tokens": micro * cfg.block_size * world,
    }


def report(results: dict, names: list[str], out: str) -> str:
    """``results``: run label ("small x 2 ranks") -> ``run_size``'s record."""
    lines = [
        "# Benchmark report",
        "",
        f"Gloo ranks on this machine ({os.cpu_count()} cores), AdamW, GPT with 64-token sequences, "
        "the same seed, data and global batch for every system. Step times are medians after warm-up; "
        "*interleaved* runs have all systems take turns step by step in one process group (machine noise hits "
        "all alike), *alone* runs time each system in its own processes (sizes whose ten copies would not fit "
        "in memory). Peak RSS and model-state bytes are measured with each system alone. Generated by "
        "`python benchmarks/suite.py`.",
    ]
    for label, r in results.items():
        timing, memory = r["timing"], r["memory"]
        base = statistics.median(timing["ddp"]["times"])
        ref_loss = timing["ddp"]["loss"]
        world = r["world"]
        lines += [
            "",
            f"## {label}: {r['params'] / 1e6:.1f}M parameters ({r['cfg'].n_layer} layers, width {r['cfg'].n_embd}), "
            f"{r['dtype']}, "
            f"{'alone' if r['alone'] else 'interleaved'}, {r['tokens']} tokens per step",
            "",
            "| system | median step ms | tokens/s | ratio to DDP | final loss | wire MB/step/rank | analytic | "
            "peak RSS/rank MiB | model state/rank MB | analytic (16 B/param ZeRO) |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name in names:
            t, m = timing[name], memory[name]
            med = statistics.median(t["times"])
            agree = abs(t["loss"] - ref_loss) <= LOSS_TOLERANCE[r["dtype"]] * abs(ref_loss)
            wire = f"{t['wire'] / 1e6:.2f}" if t["wire"] is not None else "-"
            analytic = f"{t['analytic_wire'] / 1e6:.2f}" if t["analytic_wire"] is not None else "-"
            state = f"{m['model_state'] / 1e6:.1f}" if m["model_state"] is not None else "-"
            lines.append(
                f"| {name} | {med * 1e3:.1f} | {r['tokens'] / med:.0f} | {med / base:.3f} | "
                f"{t['loss']:.4f}{'' if agree else ' (differs!)'} | {wire} | {analytic} | "
                f"{m['peak_rss'] / 2**20:.0f} | {state} | {analytic_model_state(name, r['params'], world) / 1e6:.1f} |"
            )
    if len(results) > 1:
        labels = list(results)
        header = "| system | " + " | ".join(f"{k} ({results[k]['params'] / 1e6:.1f}M)" for k in labels) + " |"
        for title, cell in (
            ("median step time (ms)", lambda r, n: f"{statistics.median(r['timing'][n]['times']) * 1e3:.1f}"),
            ("peak RSS per rank (MiB)", lambda r, n: f"{r['memory'][n]['peak_rss'] / 2**20:.0f}"),
        ):
            lines += ["", f"## Scaling: {title} by model size and ranks", "", header, "|---|" + "---|" * len(labels)]
            lines += [f"| {n} | " + " | ".join(cell(results[k], n) for k in labels) + " |" for n in names]
    plots = plot(results, names, out)
    lines += ["", *[f"![{title}]({os.path.basename(path)})" for title, path in plots]]
    return "\n".join(lines) + "\n"


def plot(results: dict, names: list[str], out: str) -> list[tuple[str, str]]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plots skipped: pip install matplotlib")
        return []
    made = []
    for label, r in results.items():
        base = statistics.median(r["timing"]["ddp"]["times"])
        ratios = [statistics.median(r["timing"][n]["times"]) / base for n in names]
        fig, ax = plt.subplots(figsize=(8, 3.5))
        ax.bar(
            names,
            ratios,
            color=["#888" if n in ("ddp", "fsdp2") or n.startswith("deepspeed") else "#2a6" for n in names],
        )
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_ylabel("step time / DDP")
        ax.set_title(f"{label}: {r['params'] / 1e6:.1f}M parameters")
        ax.tick_params(axis="x", rotation=45)
        fig.tight_layout()
        path = os.path.join(out, f"step_time_{label.replace(' ', '_')}.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        made.append((f"step time ratio, {label}", path))
    return made


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", nargs="+", default=DEFAULT_RUNS, help="SIZE:RANKS pairs, sizes: " + ", ".join(SIZES))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--out", default="docs/benchmark-report")
    parser.add_argument("--alone", action="store_true", help="time every system alone, even when all fit at once")
    parser.add_argument("--no_deepspeed", action="store_true")
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=["fp32", "bf16"],
        choices=["fp32", "bf16"],
        help="bf16: DDP under torch.autocast, FSDP2 with a bf16 MixedPrecisionPolicy, zeroshard and DeepSpeed with "
        "bf16.enabled",
    )
    args = parser.parse_args()
    runs = []
    for spec in args.runs:
        size, _, world = spec.partition(":")
        if size not in SIZES or not world.isdigit():
            parser.error(f"--runs {spec!r}: expected SIZE:RANKS with SIZE one of {', '.join(SIZES)}, e.g. small:2")
        runs.append((size, int(world)))
    names = ["ddp", "fsdp2"]
    if not args.no_deepspeed and have_deepspeed():
        names += ["deepspeed-1", "deepspeed-2", "deepspeed-3"]
    names += ["zeroshard-0", "zeroshard-1", "zeroshard-2", "zeroshard-3", "zeroshard-3-offload"]
    os.makedirs(args.out, exist_ok=True)
    results = {}
    for dtype in args.dtypes:
        for size, world in tqdm(runs, desc=f"suite, {dtype}", unit="run"):
            alone = True if args.alone else None
            results[f"{size} x {world} ranks, {dtype}"] = run_size(
                size, world, args.steps, args.micro, args.warmup, names, alone, dtype
            )
    text = report(results, names, args.out)
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write(text)
    print(text)
    return results


if __name__ == "__main__":
    main()
