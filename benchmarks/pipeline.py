"""Pipeline parallelism against data parallelism on the same ranks: a small GPT as a ``PipelineModule`` (tied
embedding and head, ``--layers`` transformer blocks), trained on the same global batch by PP over all ranks (1F1B,
``--micro_batches`` micro-batches), PP2 x DP2 with ZeRO-1, ZeRO-2 and ZeRO-3, PP2 x TP2, PP2 x SP2 (Ulysses attention
over each stage's two ranks) and PP2 x DP2 x EP2 (every other block's MLP 4 experts over each stage's data-parallel
ranks) at 4 ranks, DP with ZeRO-1 and DP with ZeRO-3 (a plain module over the same layers); DeepSpeed 0.19.8's
pipeline engine joins the turns when it imports and runs here.

    python benchmarks/pipeline.py [--world 2] [--hidden 256] [--layers 8] [--micro 4] [--seq 64] [--micro_batches 8]
    PYTHONPATH=/tmp/dsenv DS_ACCELERATOR=cpu python benchmarks/pipeline.py   # with DeepSpeed beside

The systems take turns step by step in one process group, so machine noise hits all alike. Per system: median step
time; for pipelines, the bubble: the fraction of the step each stage spent waiting in receives (measured; the
transfers are in it too), beside the schedule's own (``zeroshard.pipe.simulate``'s clock, stages of equal cost):
(p - 1) / (m + p - 1) for 1F1B, (p - 1) / (3m + p - 1) for ZB-H1 (``pipeline.schedule: "zb-h1"``, each backward
split in two; its rows end in ``zb-h1``) and DualPipeV with its split (a ``DualPipeVModule``, two stages per rank;
rows ending in ``dualpipev``); rows ending in ``time`` split the layers by their measured time,
``partition_method="time"``; rows ending in ``interleaved`` run interleaved 1F1B, two stages per rank
(``stages_per_rank=2``: (p - 1) / (2m + p - 1)); the bytes each rank
sends per step (the engine's ledger: ``send`` on the pipe group, and the data-parallel reductions) against the
analytic bytes between
stages: per micro-batch, the activation (micro x seq x hidden x 4 bytes; a tensor-parallel rank sends half of it) and
a word forward (the announcement goes once, and again when it changes), the gradient and a status word back;
model-state bytes per rank between steps against the analytic count (``analytic_state``); the compute-only limit of
each pipeline layout: a second engine built alike runs the stage's own work (each micro-batch's forward and backward
on stand-in activations, then the step) inside ``zeroshard.testing.compute_only``, nothing communicated and no stage
waiting for another; the final loss (every system the same but the MoE model's). ``--only NAME[,NAME...]`` runs
those systems alone and adds their peak RSS.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from zeroshard.testing import run_distributed

VOCAB = 512


class Embed(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(VOCAB, hidden) * 0.02)

    def forward(self, ids):
        return self.weight[ids]


HEADS = 8


def causal_attention(q, k, v):
    """Per head over [batch, tokens, heads, head_dim]."""
    out = nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
    return out.transpose(1, 2)


class Block(nn.Module):
    """A pre-norm transformer block. ``group``: a sequence-parallel group its tokens are split over (attention
    trades them for heads, DeepSpeed's ``DistributedAttention``); ``experts``: its MLP is DeepSpeed's MoE layer with
    that many experts over ``ep`` ranks (top-1, no token dropped)."""

    def __init__(self, hidden: int, group=None, experts: int = 0, ep: int = 1):
        super().__init__()
        from zeroshard.compat.deepspeed.sequence.layer import DistributedAttention
        from zeroshard.moe import MoE

        self.ln_1, self.ln_2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.attend = causal_attention if group is None else DistributedAttention(causal_attention, group, 2, 1)
        mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
        self.mlp = MoE(hidden, mlp, experts, ep_size=ep, k=1, drop_tokens=False, use_rts=False) if experts else mlp

    def forward(self, x):
        batch, tokens, hidden = x.shape
        q, k, v = self.qkv(self.ln_1(x)).view(batch, tokens, 3, HEADS, hidden // HEADS).unbind(2)
        x = x + self.proj(self.attend(q, k, v).reshape(batch, tokens, hidden))
        out = self.mlp(self.ln_2(x))
        return x + (out[0] if isinstance(out, tuple) else out)


class Norm(nn.LayerNorm):
    pass


def logits(embed: Embed, x):
    return x @ embed.weight.t()


def loss_fn(out, labels):
    return nn.functional.cross_entropy(out.reshape(-1, VOCAB), labels.reshape(-1))


def layers(args, group=None, ep: int = 0) -> list:
    """The model's layers; ``group``: attention over that sequence-parallel group; ``ep``: every other block's MLP
    4 experts over ``ep`` ranks."""
    from zeroshard.pipe import LayerSpec, TiedLayerSpec

    def block(k: int):
        return LayerSpec(Block, args.hidden, group, 4, ep) if ep and k % 2 else LayerSpec(Block, args.hidden, group)

    return [
        TiedLayerSpec("embed", Embed, args.hidden),
        *[block(k) for k in range(args.layers)],
        LayerSpec(Norm, args.hidden),
        TiedLayerSpec("embed", Embed, args.hidden, forward_fn=logits),
    ]


class Whole(nn.Module):
    """The same layers as one module (DP runs it, ZeRO-3 gathering each block)."""

    def __init__(self, args):
        super().__init__()
        from zeroshard.pipe import PipelineModule

        self.layers = PipelineModule(layers(args), num_stages=1, seed_layers=True, partition_method="uniform")

    def forward(self, ids, labels):
        return loss_fn(self.layers(ids), labels)


# AutoTP inside the stages (PP2 x TP2): each block's MLP split, column then row (the attention stays replicated)
TENSOR_PARALLEL = {
    "autotp_size": 2,
    "partition_config": {
        "use_default_specs": False,
        "layer_specs": [
            {"patterns": [r".*\.mlp\.0$"], "partition_type": "column"},
            {"patterns": [r".*\.mlp\.2$"], "partition_type": "row"},
        ],
    },
}


def config(args, micro_batches: int, stage: int, tp: int = 1) -> dict:
    return {
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": micro_batches,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": 0,
            "gather_unit_classes": ["Block"],
        },
        "gradient_clipping": 1.0,
        **({"tensor_parallel": TENSOR_PARALLEL} if tp > 1 else {}),
    }


@dataclass(frozen=True)
class Layout:
    """A pipeline layout: ``dp`` data-parallel ranks per stage, ``tp`` tensor-, ``sp`` sequence-parallel ranks,
    ``ep`` ranks splitting each MoE block's experts (out of the stage's data-parallel ranks)."""

    name: str
    stages: int
    dp: int
    zero: int
    tp: int = 1
    sp: int = 1
    ep: int = 0
    schedule: str = "1f1b"  # pipeline.schedule
    partition: str = "parameters"  # partition_method ("time": each layer timed on the first micro-batch)
    dual: bool = False  # a DualPipeVModule (the DualPipeV schedule)
    per_rank: int = 1  # stages_per_rank (interleaved 1F1B when 2 or more)


PIPELINES_4 = [  # DeepSpeed refuses ZeRO 2-3 with pipelines, and has no sequence parallelism in them
    Layout("PP2 x DP2", 2, 2, 1),
    Layout("PP2 x DP2 ZeRO-2", 2, 2, 2),
    Layout("PP2 x DP2 ZeRO-3", 2, 2, 3),
    Layout("PP2 x TP2", 2, 1, 1, tp=2),
    Layout("PP2 x SP2", 2, 1, 1, sp=2),
    Layout("PP2 x DP2 x EP2", 2, 2, 1, ep=2),
]


def pipeline_engine(args, layout: Layout):
    import zeroshard
    from zeroshard.pipe import DualPipeVModule, PipelineModule
    from zeroshard.sequence_parallel import sequence_parallel_groups

    groups = sequence_parallel_groups(layout.sp) if layout.sp > 1 else None
    group = groups.sequence if groups is not None else None  # zeroshard's group: attention counted in the ledger
    profile = batch(args, 0)[0] if layout.partition == "time" else None
    kind, extra = (DualPipeVModule, {}) if layout.dual else (PipelineModule, {"stages_per_rank": layout.per_rank})
    module = kind(layers(args, group, layout.ep), num_stages=layout.stages, loss_fn=loss_fn, seed_layers=True,
                  partition_method=layout.partition, profile_batch=profile, **extra)  # fmt: skip
    cfg = config(args, args.micro_batches // layout.dp, layout.zero, layout.tp)
    cfg["pipeline"] = {"schedule": layout.schedule}
    return zeroshard.initialize(model=module, config=cfg, mpu=groups)[0]


def systems(args) -> dict:
    """name -> (engine, data-parallel size, stages, the layout's ZeRO stage and tensor-parallel size); each pipeline
    layout also as ``<name> limit``: a second engine built alike, for the compute-only limit."""
    import zeroshard
    from zeroshard.pipe import PipelineModule

    world, m = args.world, args.micro_batches
    layouts = [Layout(f"PP{world}", world, 1, 1), Layout(f"PP{world} zb-h1", world, 1, 1, schedule="zb-h1"),
               Layout(f"PP{world} time", world, 1, 1, partition="time"),
               Layout(f"PP{world} dualpipev", world, 1, 1, dual=True),
               Layout(f"PP{world} interleaved", world, 1, 1, per_rank=2)]  # fmt: skip
    layouts += PIPELINES_4 if world == 4 else []
    out = {}
    for layout in layouts:
        if chosen_by(args, layout.name):
            for name in (layout.name, f"{layout.name} limit"):
                out[name] = (pipeline_engine(args, layout), layout.dp, layout.stages, layout.zero)
    module = PipelineModule(layers(args), num_stages=1, loss_fn=loss_fn, seed_layers=True)
    out[f"DP{world} ZeRO-1"] = (zeroshard.initialize(model=module, config=config(args, m // world, 1))[0], world, 1, 1)
    engine = zeroshard.initialize(model=Whole(args), config=config(args, m // world, 3))
    out[f"DP{world} ZeRO-3"] = (engine[0], world, 1, 3)
    for name, dual in ((f"DeepSpeed 0.19.8 PP{world}", False), (f"DeepSpeed 0.19.8 PP{world} dualpipev", True)):
        deepspeed = deepspeed_pipeline(args, dual) if chosen_by(args, name) else None
        if deepspeed is not None:
            out[name] = (deepspeed, 1, world, 1)
    return {name: value for name, value in out.items() if chosen_by(args, name.removesuffix(" limit"))}


def chosen_by(args, name: str) -> bool:
    """``--only`` names one system, or several separated by commas (``--only "PP4,PP4 zb-h1"``)."""
    return args.only is None or name in args.only.split(",")


def deepspeed_pipeline(args, dual: bool = False):
    """DeepSpeed's own pipeline engine on the same layers (its LayerSpec classes; ``dual``: its DualPipeVModule, which
    it runs without a B/W split), or None where it does not import or run here; the reason is printed."""
    try:
        import deepspeed
        from deepspeed.pipe import DualPipeVModule, LayerSpec, PipelineModule, TiedLayerSpec
    except ImportError:
        return None
    specs = [
        TiedLayerSpec("embed", Embed, args.hidden),
        *[LayerSpec(Block, args.hidden) for _ in range(args.layers)],
        LayerSpec(Norm, args.hidden),
        TiedLayerSpec("embed", Embed, args.hidden, forward_fn=logits),
    ]
    try:
        deepspeed.init_distributed(dist_backend="gloo")  # adopts the process group the harness made
        kind = DualPipeVModule if dual else PipelineModule
        module = kind(specs, num_stages=args.world, loss_fn=loss_fn)  # its seed_layers fails on CPU
        whole = Whole(args).layers.state_dict()  # the same weights as the other systems, by name
        module.load_state_dict({name: whole[name] for name in module.state_dict()})
        cfg = config(args, args.micro_batches, 1)
        cfg["zero_optimization"] = {"stage": 1}  # without zeroshard's stage-3 keys, which DeepSpeed's schema refuses
        cfg["optimizer"]["params"]["torch_adam"] = True
        return deepspeed.initialize(model=module, model_parameters=module.parameters(), config=cfg)[0]
    except Exception as err:  # noqa: BLE001 - reported, the other systems run
        print(f"DeepSpeed's pipeline engine does not run here: {type(err).__name__}: {err}")
        return None


def batch(args, step: int) -> list:
    """The step's global batch: ``micro_batches`` micro-batches of (ids, labels)."""
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (args.micro_batches, args.micro, args.seq + 1), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def own_micro_batches(engine, dp: int, stages: int, micro_batches: list) -> list:
    """This rank's micro-batches of the global batch: its data-parallel rank's, and of those its sequence-parallel
    rank's piece of the tokens."""
    from zeroshard import comm

    gas = len(micro_batches) // dp
    rank = engine.grid.get_data_parallel_rank() if stages > 1 and hasattr(engine, "grid") else comm.get_rank() % dp
    own = micro_batches[rank * gas : (rank + 1) * gas]
    sequence = engine.mesh.sequence if hasattr(engine, "mesh") else None
    if sequence is None or sequence.size == 1:
        return own
    piece = own[0][0].shape[1] // sequence.size
    tokens = slice(sequence.rank * piece, (sequence.rank + 1) * piece)
    return [(ids[:, tokens], labels[:, tokens]) for ids, labels in own]


def one_step(engine, dp: int, stages: int, micro_batches: list) -> float:
    from zeroshard import comm

    gas = len(micro_batches) // dp
    batches = own_micro_batches(engine, dp, stages, micro_batches)
    if hasattr(engine, "train_batch"):
        return float(engine.train_batch(iter(batches)))
    total = torch.zeros(1)
    for ids, labels in batches:
        loss = engine(ids, labels)
        engine.backward(loss)
        engine.step()
        total += loss.item() / gas
    comm.all_reduce(total, comm.Group("world", tuple(range(comm.get_world_size())), None))
    return total.item() / comm.get_world_size()  # the mean over the data-parallel ranks, as train_batch returns


def stage_work(args, engine, dp: int, micro_batches: list) -> float:
    """One step's work of this rank's stages alone (the compute-only limit; inside ``compute_only``): each of its
    micro-batches' forward and backward on each stage the rank runs (one; DualPipeV's two; an interleaved module's
    k), the model's first stage from the ids, the others from a stand-in activation (the last one's loss from the
    labels, the others' backward from a stand-in gradient), then the optimizer step."""
    batches = own_micro_batches(engine, dp, engine.num_stages, micro_batches)
    gas = len(batches)
    layout = engine._train_schedule()  # which of the model's stages the rank runs in each phase
    phases = range(layout.virtual_stages() // engine.num_stages)
    shape = (args.micro, batches[0][0].shape[1], args.hidden)  # a sequence-parallel rank's piece of the tokens
    engine.module.train()
    for phase in phases:
        engine.module.activate_phase(phase)
        virtual = layout.virtual_stage(phase)
        first, last = virtual == 0, virtual == layout.virtual_stages() - 1
        for micro, (ids, labels) in enumerate(batches):
            inputs = ids if first else torch.randn(shape, requires_grad=True)
            output = engine.module(inputs)
            if last:
                tensors, grads = [loss_fn(output, labels) * (engine.stack.loss_scale / gas)], None
            else:
                tensors, grads = [output], [torch.randn(shape) * 1e-3]
            engine._backward_from(tensors, grads, micro == gas - 1 and phase == phases[-1])
    engine._optimizer_step()
    return 0.0


def pipe_wait(engine) -> float:
    """Seconds the engine has waited in pipeline receives (0 for an engine without a pipeline of zeroshard's)."""
    return sum(exchange.waited for exchange in getattr(engine, "exchanges", ()))


def analytic_state(engine, zero: int) -> int:
    """Model-state bytes this rank should hold between steps (fp32 Adam): per parameter it holds (a tensor-parallel
    piece counted by its size), 4 bytes of parameter, 4 of gradient, 4 of master and 8 of moments; from ZeRO-1 on the
    gradient, master and moments are shards over the stage's ``d`` data-parallel ranks (ZeRO-1 holds the whole
    gradient only while it accumulates, then keeps its shard, as ZeRO-2 does), and at ZeRO-3 the parameter is its fp32
    master shard (no copy of its own). The shards of dense parameters are over the stage's data x sequence ranks, an
    expert's over the ranks holding the same experts."""
    from zeroshard.zero import GatheredParameters

    with GatheredParameters(list(engine.module.parameters())):  # ZeRO-3 keeps shards: gathered to count them whole
        sizes = {n: p.numel() for n, p in engine.module.named_parameters()}
    experts = sum(numel for name, numel in sizes.items() if ".deepspeed_experts." in name)
    parameter = 0 if zero >= 3 else 4
    total = 0.0
    for held, group in ((sum(sizes.values()) - experts, engine.mesh.shard), (experts, engine.mesh.expert_shard)):
        shards = group.size if zero >= 1 else 1
        total += held * (parameter + (4 + 12) / shards)
    return round(total)


def worker(args) -> dict:
    from zeroshard import comm
    from zeroshard.testing import compute_only

    chosen = systems(args)
    world = comm.Group("world", tuple(range(comm.get_world_size())), None)
    times = {n: [] for n in chosen}
    waits = {n: [] for n in chosen}
    wire = {n: [] for n in chosen}
    losses = {}
    for step in range(args.steps):
        micro_batches = batch(args, step)
        for name, (engine, dp, stages, _) in chosen.items():
            ours = hasattr(engine, "comm_ledger")
            if ours:
                engine.comm_ledger.reset()
            waited = pipe_wait(engine)
            limit = name.endswith(" limit")
            comm.barrier(world)
            start = time.perf_counter()
            if limit:
                with compute_only():
                    losses[name] = stage_work(args, engine, dp, micro_batches)
            else:
                losses[name] = one_step(engine, dp, stages, micro_batches)
            times[name].append(time.perf_counter() - start)
            waits[name].append(0.0 if limit else pipe_wait(engine) - waited)
            if ours and not limit:
                ledger = engine.comm_ledger.summary()
                pipe = sum(t.wire_bytes for (op, group), t in ledger.items() if group == "pipe_exchange")
                wire[name].append((sum(t.wire_bytes for t in ledger.values()), pipe))
    out = {}
    for name, (engine, dp, stages, zero) in chosen.items():
        ours = hasattr(engine, "state_bytes")
        state = engine.state_bytes() if ours else {}
        out[name] = {
            "ms": 1000 * statistics.median(times[name][2:]),
            "bubble": statistics.median(w / t for w, t in zip(waits[name][2:], times[name][2:])),
            "wire": statistics.median(w[0] for w in wire[name][2:]) if wire[name] else None,
            "pipe": statistics.median(w[1] for w in wire[name][2:]) if wire[name] else None,
            "state": sum(v for k, v in state.items() if k not in ("idle_buffers", "staging", "gathered")),
            "analytic_state": analytic_state(engine, zero) if ours else None,
            "loss": losses[name],
            "stages": stages,
            "dp": dp,
            "tp": engine.mesh.tensor.size if ours else 1,
            "sp": engine.mesh.sequence.size if ours else 1,
        }
    out["rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def analytic_pipe_bytes(
    args, stage: int, stages: int, dp: int, tp: int = 1, sp: int = 1, dual: bool = False, per_rank: int = 1
) -> int:
    """Bytes stage ``stage`` sends its neighbours per step: each of its m micro-batches' activation after a word
    forward (the announcement itself went with the first step's first activation), the gradient after a status word
    back; a tensor-parallel rank its 1/tp slice of each (``pipeline.pipe_partitioned``), a sequence-parallel rank
    its 1/sp piece of the tokens. DualPipeV (``dual``): the same for each of the rank's two stages, the second's
    activations going back towards rank 0 and nothing crossing the turn on the last rank; interleaved (``per_rank``
    k): its other k - 1 stages send both ways (only the model's first stage sends no gradient back, only its last
    no activation on)."""
    m = args.micro_batches // dp
    activation = args.micro * args.seq * args.hidden * 4 // (tp * sp)
    forward = (8 + activation) if stage < stages - 1 else 0
    backward = (8 + activation) if stage > 0 else 0
    turned = (forward + backward) if dual else 0  # phase 1: to stage - 1 unless 0, back to stage + 1 unless last
    looped = (per_rank - 1) * 2 * (8 + activation)
    return m * (forward + backward + turned + looped)


def schedule_bubble(name: str, stages: int, micro_batches: int) -> Optional[float]:
    """The row's schedule's own bubble on ``zeroshard.pipe.simulate``'s clock (every stage alike)."""
    from zeroshard.pipe import DualPipeVSchedule, TrainSchedule, simulate
    from zeroshard.pipe.interleaved import Interleaved1F1BSchedule
    from zeroshard.pipe.simulate import bubbles
    from zeroshard.pipe.zero_bubble import ZeroBubbleH1Schedule

    if stages == 1:
        return None
    if name.endswith("interleaved"):
        make = lambda s: Interleaved1F1BSchedule(micro_batches, stages, s, chunks=2)  # noqa: E731
    elif name.endswith("dualpipev"):  # DeepSpeed's own runs it without the B/W split
        split = not name.startswith("DeepSpeed")
        make = lambda s: DualPipeVSchedule(micro_batches, stages, s, split_backward=split)  # noqa: E731
    else:
        kind = ZeroBubbleH1Schedule if name.endswith("zb-h1") else TrainSchedule
        make = lambda s: kind(micro_batches, stages, s)  # noqa: E731
    return max(bubbles(simulate(make, stages, training=True)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2, choices=(2, 4))
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--micro_batches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--only", default=None)
    args = parser.parse_args()
    # --only reports a peak RSS, a whole process's: fresh interpreters then, as launched
    results = run_distributed(worker, args.world, args, timeout_s=3600, fresh_interpreters=args.only is not None)
    print("| system | median step (ms) | ratio to DP ZeRO-1 | ratio to its compute-only limit | bubble measured (per "
          "stage) | the schedule's | pipe MB/step/rank (analytic) | wire MB/step/rank | state MB/rank (analytic) | "
          "final loss |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    base = results[0].get(f"DP{args.world} ZeRO-1", {}).get("ms")
    for name, row in results[0].items():
        if name == "rss_mb" or name.endswith(" limit"):
            continue
        stages, dp, tp, sp = row["stages"], row["dp"], row["tp"], row["sp"]
        per_stage = dp * tp * sp
        limits = [r[f"{name} limit"]["ms"] for r in results] if f"{name} limit" in results[0] else None
        m = args.micro_batches // dp
        measured = stages > 1 and row["wire"] is not None  # DeepSpeed's engine: neither waits nor ledger here
        bubbles = " / ".join(f"{r[name]['bubble']:.2f}" for r in results[::per_stage]) if measured else "-"
        theory = schedule_bubble(name, stages, m)
        theory = f"{theory:.2f}" if theory is not None else "-"
        pipe = "-"
        if stages > 1 and row["pipe"] is not None:
            measured = [r[name]["pipe"] for r in results]
            dual, per_rank = name.endswith("dualpipev"), 2 if name.endswith("interleaved") else 1
            analytic = [analytic_pipe_bytes(args, r // per_stage, stages, dp, tp, sp, dual, per_rank)
                        for r in range(args.world)]  # fmt: skip
            pipe = " / ".join(f"{a / 1e6:.3f} ({b / 1e6:.3f})" for a, b in zip(measured, analytic))
        wire = f"{row['wire'] / 1e6:.2f}" if row["wire"] is not None else "-"
        ratio = f"{row['ms'] / base:.3f}" if base else "-"
        state = f"{row['state'] / 1e6:.3f} ({row['analytic_state'] / 1e6:.3f})" if row["wire"] is not None else "-"
        to_limit = f"{row['ms'] / max(limits):.3f}" if limits else "-"  # the slowest stage's own work bounds the step
        print(f"| {name} | {row['ms']:.1f} | {ratio} | {to_limit} | {bubbles} | {theory} | {pipe} | {wire} | {state} | "
              f"{row['loss']:.4f} |")  # fmt: skip
    if args.only:
        print(f"peak RSS per rank (MB): {[round(r['rss_mb']) for r in results]}")


if __name__ == "__main__":
    main()
