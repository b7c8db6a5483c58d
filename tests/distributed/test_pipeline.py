"""Pipeline parallelism (``deepspeed.pipe.PipelineModule`` through ``initialize``), on 4 and 3 Gloo ranks against one
process running the same layers in sequence on the global batch: the same loss each step and the same weights after
5 AdamW steps at PP4, PP2 x DP2 and PP3, 1 and 8 micro-batches, each partition method, ZeRO 0-3; with tensor,
expert and sequence parallelism inside the stages; checkpoints across layouts; the tied
embedding equal on the stages holding it; tuples of mixed dtypes between stages; activation checkpointing
bit-identical; ``eval_batch``; DeepSpeed's clients' uses of the surface; failures named on every rank.

One spawn per world size runs every case (process start-up dominates these tiny models); the one-process references
are computed here, in pytest's process, once per test."""

from __future__ import annotations

import functools
import math
import re

import pytest
import torch
from torch import nn

from zeroshard.testing import run_distributed

VOCAB, DIM, SEQ, MICRO, STEPS, LR, CLIP = 32, 16, 6, 2, 5, 1e-2, 0.5


class Embed(nn.Module):
    def __init__(self, vocab: int = VOCAB, dim: int = DIM):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, dim) * 0.5)

    def forward(self, ids):
        return self.weight[ids]


class Block(nn.Module):
    def __init__(self, dim: int = DIM):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.out(torch.nn.functional.gelu(self.fc(self.norm(x))))


class Norm(nn.LayerNorm):
    def __init__(self, dim: int = DIM):
        super().__init__(dim)


def logits(embed: Embed, x):
    return x @ embed.weight.t()


def cross_entropy(out, labels):
    return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), labels.reshape(-1))


def specs(blocks: int = 6, tied: bool = True) -> list:
    from zeroshard.pipe import LayerSpec, TiedLayerSpec

    first = TiedLayerSpec("embed", Embed) if tied else LayerSpec(Embed)
    last = TiedLayerSpec("embed", Embed, forward_fn=logits) if tied else LayerSpec(nn.Linear, DIM, VOCAB)
    return [first, *[LayerSpec(Block) for _ in range(blocks)], LayerSpec(Norm), last]


class TupleEmbed(nn.Module):
    """ids -> (fp32 hidden states, an int64 mask, a bf16 side tensor): diffusion-pipe's mixed-dtype activations."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(VOCAB, DIM) * 0.5)

    def forward(self, ids):
        x = self.weight[ids]
        return x, (ids % 3 != 0).long(), (x * 0.5).to(torch.bfloat16)


class TupleBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()

    def forward(self, inputs):
        x, mask, side = inputs
        x = self.block(x + side.float()) * mask.unsqueeze(-1).float() + x * (1 - mask.unsqueeze(-1).float())
        return x, mask, (x * 0.25).to(torch.bfloat16)


class TupleHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, VOCAB)

    def forward(self, inputs):
        x, _, side = inputs
        return self.proj(x + side.float())


class MoEBlock(nn.Module):
    """A block whose MLP is DeepSpeed's MoE layer: 4 experts over ``ep`` ranks, top-1, no token dropped (each rank's
    tokens routed as one process routes them); its output only (the aux loss is not this model's loss)."""

    def __init__(self, ep: int = 1):
        from zeroshard.moe import MoE

        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        expert = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
        self.moe = MoE(DIM, expert, num_experts=4, ep_size=ep, k=1, drop_tokens=False, use_rts=False)

    def forward(self, x):
        return x + self.moe(self.norm(x))[0]


def moe_specs(ep: int) -> list:
    """The tied model with every other block a mixture of experts over ``ep`` ranks."""
    from zeroshard.pipe import LayerSpec

    layer_specs = specs()
    return [*layer_specs[:1], *[LayerSpec(MoEBlock, ep) if k % 2 else s for k, s in enumerate(layer_specs[1:-2])],
            *layer_specs[-2:]]  # fmt: skip


def moe_case(stage: int, ckpt_dir: str = None) -> dict:
    """PP2 x DP2 with expert parallelism over each stage's 2 data-parallel ranks (DeepSpeed's layer, ep_size 2):
    its losses, this stage's weights (each rank's experts as it holds them) and its expert rank; saved at the end
    under ``pp2_ep2`` when ``ckpt_dir`` is given."""
    import zeroshard
    from zeroshard.pipe import PipelineModule

    module = PipelineModule(moe_specs(2), num_stages=2, loss_fn=cross_entropy, seed_layers=True)
    engine, *_ = zeroshard.initialize(model=module, config=config(4, stage))
    dp = engine.grid.get_data_parallel_rank()
    losses = [engine.train_batch(iter(step[dp * 4 : (dp + 1) * 4])).item() for step in global_batches(2, 4)]
    out = {"losses": losses, "weights": weights_of(module), "expert_rank": engine.mesh.expert.rank}
    out["experts"] = engine.mesh.expert.size
    if ckpt_dir is not None:
        engine.save_checkpoint(ckpt_dir, tag="pp2_ep2")
    engine.destroy()
    return out


HEADS = 2


def core_attention(q, k, v):
    """Causal attention per head over [batch, tokens, heads, head_dim]."""
    out = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
    return out.transpose(1, 2)


class Attention(nn.Module):
    """A causal self-attention block. Given a sequence-parallel group, each rank holds a piece of the tokens and
    DeepSpeed's ``DistributedAttention`` trades it for a piece of the heads around the core (Ulysses)."""

    def __init__(self, group=None):
        from zeroshard.compat.deepspeed.sequence.layer import DistributedAttention

        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)  # a key bias has no gradient: Adam would step its noise
        self.out = nn.Linear(DIM, DIM)
        self.attend = core_attention if group is None else DistributedAttention(core_attention, group, 2, 1)

    def forward(self, x):
        batch, tokens, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(batch, tokens, 3, HEADS, DIM // HEADS).unbind(2)
        return x + self.out(self.attend(q, k, v).reshape(batch, tokens, DIM))


def attention_specs(group=None) -> list:
    """The tied model with every other block an attention block (over ``group``'s ranks when given)."""
    from zeroshard.pipe import LayerSpec

    first, *blocks, norm, last = specs(blocks=4)
    return [first, *[LayerSpec(Attention, group) if k % 2 == 0 else s for k, s in enumerate(blocks)], norm, last]


def sequence_parallel_batches() -> list:
    """One data-parallel rank's micro-batches per step, some labels -100 (not counted): in the first micro-batch
    of each step the whole second half of every sequence, so one sequence-parallel rank's piece counts no token."""
    out = []
    for step in global_batches(1, 4, seed=3):
        masked = []
        for micro, (x, y) in enumerate(step):
            y = y.masked_fill(x % 5 == 0, -100)
            masked.append((x, y.masked_fill(torch.arange(SEQ) >= SEQ // 2, -100) if micro == 0 else y))
        out.append(masked)
    return out


def sequence_parallel_case(stage: int, ckpt_dir: str = None) -> dict:
    """PP2 x SP2: each stage's 2 ranks hold half of every sequence's tokens (Ulysses attention over the group
    ``sequence_parallel_groups`` registered, the loss token-weighted over it): its losses, this stage's weights and
    the grid's view; saved at the end under ``pp2_sp2`` when ``ckpt_dir`` is given."""
    import zeroshard
    from zeroshard.pipe import PipelineModule
    from zeroshard.sequence_parallel import sequence_parallel_groups, token_weighted_loss

    groups = sequence_parallel_groups(2)

    def loss_fn(out, labels):  # DeepSpeed's clients pass the torch group: either does
        return token_weighted_loss(cross_entropy(out, labels), labels, groups.get_sequence_parallel_group())

    # the registration's group itself, so attention's exchanges count in the engine's ledger
    module = PipelineModule(attention_specs(groups.sequence), num_stages=2, loss_fn=loss_fn, seed_layers=True)
    engine, *_ = zeroshard.initialize(model=module, config=config(4, stage), mpu=groups)
    piece = slice(groups.get_sequence_parallel_rank() * SEQ // 2, (groups.get_sequence_parallel_rank() + 1) * SEQ // 2)
    losses = []
    for step in sequence_parallel_batches():
        engine.comm_ledger.reset()
        losses.append(engine.train_batch(iter([(x[:, piece], y[:, piece]) for x, y in step])).item())
    topology = engine.grid.topology()
    out = {"losses": losses, "weights": weights_of(module), "axes": topology.get_axis_names(), "dims": topology.dims}
    out["all_to_all"] = engine.comm_ledger.summary()[("all_to_all", "sequence")].bytes  # the last step's
    out["attention_layers"] = sum(isinstance(m, Attention) for m in module.modules())
    out["sequence_rank"], out["stage"] = engine.mesh.sequence.rank, engine.stage_id
    if ckpt_dir is not None:
        engine.save_checkpoint(ckpt_dir, tag="pp2_sp2")
    engine.destroy()
    return out


def load_case(ckpt_dir: str, tag: str, layer_specs: list) -> dict:
    """PP4 under ZeRO-1 (one data-parallel rank, no sequence or expert parallelism) loads checkpoint ``tag``: what
    each stage holds after the load."""
    import zeroshard
    from zeroshard.pipe import PipelineModule

    module = PipelineModule(layer_specs, num_stages=4, loss_fn=cross_entropy, seed_layers=True)
    engine, *_ = zeroshard.initialize(model=module, config=config(4, 1))
    engine.load_checkpoint(ckpt_dir, tag=tag)
    out = {"weights": weights_of(module), "global_steps": engine.global_steps}
    engine.destroy()
    return out


def as_one_process_names(name: str, expert_rank: int) -> str:
    """A parameter's name as one process numbers it: an expert rank's local expert i of the 2 it holds is expert
    ``expert_rank * 2 + i`` (other names are the same)."""
    split = re.match(r"(.*\.deepspeed_experts\.)(\d+)(\..*)", name)
    if split is None:
        return name
    head, index, tail = split.groups()
    return f"{head}{expert_rank * 2 + int(index)}{tail}"


def tuple_specs() -> list:
    from zeroshard.pipe import LayerSpec

    return [LayerSpec(TupleEmbed), *[LayerSpec(TupleBlock) for _ in range(4)], LayerSpec(TupleHead)]


def global_batches(world_batches: int, gas: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per step, the global batch's micro-batches in order: data-parallel rank d reads ``[d * gas, (d + 1) * gas)``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (world_batches * gas, MICRO, SEQ + 1), generator=g)
        out.append([(ids[k, :, :-1], ids[k, :, 1:]) for k in range(world_batches * gas)])
    return out


def reference(layer_specs: list, batches: list, clip: float = CLIP) -> dict:
    """One process: the same layers (seeded as the pipeline seeds them) in sequence, each step's loss the mean over
    the global batch's micro-batches."""
    from zeroshard.pipe import PipelineModule

    model = PipelineModule(
        layer_specs, num_stages=1, seed_layers=True, loss_fn=cross_entropy, partition_method="uniform"
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for step_batches in batches:
        optimizer.zero_grad()
        total = sum(cross_entropy(model(x), y) for x, y in step_batches) / len(step_batches)
        total.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        losses.append(total.item())
    return {"losses": losses, "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


ZERO3 = {  # every parameter sharded (none persistent), each Block a gather unit, gathers prefetched within a budget
    "stage3_param_persistence_threshold": 0,
    "gather_unit_classes": ["Block"],
    "stage3_prefetch_bucket_size": 600,
    "stage3_max_live_parameters": 2000,
}


def assert_like_one_process(got: dict, expected: dict, losses_within: float, rank: int, held=None) -> None:
    """A rank's run against one process's (``reference``): every loss within ``losses_within``, every weight within
    1e-5. ``held(weights, name)``: what this rank holds of the one process's tensor (default: ``weights[name]``)."""
    assert max(abs(a - b) for a, b in zip(got["losses"], expected["losses"])) <= losses_within, (rank, got["losses"])
    for name, value in got["weights"].items():
        want = held(expected["weights"], name) if held is not None else expected["weights"][name]
        torch.testing.assert_close(value, want, rtol=1e-5, atol=1e-5, msg=name)


def config(gas: int, stage: int, **extra) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage, **(ZERO3 if stage == 3 else {})},
        "gradient_clipping": CLIP,
        **extra,
    }


def weights_of(module) -> dict:
    """This rank's parameters, whole (ZeRO-3 keeps shards only: gathered for the copy; every rank calls it)."""
    from zeroshard.zero import GatheredParameters

    with GatheredParameters(list(module.parameters())):
        return {n: p.detach().clone() for n, p in module.named_parameters()}


def train_case(
    stages: int,
    gas: int,
    partition: str,
    stage: int,
    tied: bool = True,
    interval: int = 0,
    extra: dict = None,
    topology=None,
    dual: bool = False,
    stages_per_rank: int = 1,
) -> dict:
    """Train the pipeline STEPS batches; returns its losses, this stage's weights (and how the tensor-parallel ones
    are split) and the tied weight after each step. ``topology``: built on it instead of ``stages``; ``dual``: a
    ``DualPipeVModule`` (two stages per rank, the DualPipeV schedule)."""
    import zeroshard
    from zeroshard.pipe import DualPipeVModule, PipelineModule
    from zeroshard.zero import GatheredParameters

    layer_specs = specs(tied=tied)
    module = (DualPipeVModule if dual else PipelineModule)(
        layer_specs,
        num_stages=None if topology is not None else stages,
        topology=topology,
        loss_fn=cross_entropy,
        seed_layers=True,
        partition_method=partition,
        activation_checkpoint_interval=interval,
        profile_batch=global_batches(1, 1)[0][0] if partition == "time" else None,
        **({"stages_per_rank": stages_per_rank} if stages_per_rank > 1 else {}),
    )
    engine, *_ = zeroshard.initialize(model=module, config=config(gas, stage, **(extra or {})))
    batches = global_batches(engine.grid.get_data_parallel_world_size(), gas)
    dp = engine.grid.get_data_parallel_rank()
    losses, tied_after = [], []
    for step_batches in batches:
        engine.comm_ledger.reset()
        losses.append(engine.train_batch(iter(step_batches[dp * gas : (dp + 1) * gas])).item())
        with GatheredParameters(list(module.tied_modules.parameters())):  # ZeRO-3 keeps shards; every rank calls it
            if "embed" in module.tied_modules:
                tied_after.append(module.tied_modules["embed"].weight.detach().clone())
    weights = weights_of(module)
    ledger = engine.comm_ledger.summary()
    sent = sum(t.wire_bytes for (op, group), t in ledger.items() if group == "pipe_exchange")
    gathers = sum(t.calls for (op, group), t in ledger.items() if op == "all_gather" and group == "shard")
    result = {"losses": losses, "weights": weights, "tied": tied_after, "parts": module.parts, "stage": engine.stage_id}
    result["sent_between_stages"] = sent  # the last step's
    result["gathers"] = gathers
    result["splits"], result["tp_rank"] = dict(engine.tensor_splits), engine.mesh.tensor.rank
    result["peak"] = engine.peak_micro_batches_in_flight
    engine.destroy()
    return result


CASES_4 = [  # (stages, gas, partition, ZeRO stage)
    (4, 1, "parameters", 1),
    (4, 8, "uniform", 0),
    (2, 1, "type:block", 1),
    (2, 8, "parameters", 1),
    (2, 8, "uniform", 0),
    (2, 8, "parameters", 2),  # DeepSpeed refuses ZeRO-2 with pipelines: each stage's gradients and Adam state sharded
    (2, 8, "parameters", 3),  # and ZeRO-3: each stage's parameters too, gathered within the stage, 1F1B interleaved
]


# AutoTP over the blocks: fc column-parallel, out row-parallel (the embedding, norms and head stay replicated)
TENSOR_PARALLEL = {
    "partition_config": {
        "use_default_specs": False,
        "layer_specs": [
            {"patterns": [r".*\.fc$"], "partition_type": "column"},
            {"patterns": [r".*\.out$"], "partition_type": "row"},
        ],
    }
}


WHOLE = {"pipe_partitioned": False, "grad_partitioned": False}  # each tensor-parallel rank sends everything


def tensor_parallel_cases() -> dict:
    """PP2 x TP2 on 4 ranks, both ways clients ask for it: ``num_stages`` with ``tensor_parallel.autotp_size``
    (ZeRO-1), and gpt-neox's ``PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1)`` with no size in the
    config (ZeRO-2)."""
    from zeroshard.pipe import PipeModelDataParallelTopology

    autotp = {"tensor_parallel": {**TENSOR_PARALLEL, "autotp_size": 2}}
    topology = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1)
    return {
        "autotp": train_case(2, 4, "parameters", 1, extra=autotp),
        "zero3": train_case(2, 4, "parameters", 3, extra=autotp),
        "whole": train_case(2, 4, "parameters", 1, extra={**autotp, "pipeline": WHOLE}),
        "topology": train_case(2, 4, "parameters", 2, extra={"tensor_parallel": TENSOR_PARALLEL}, topology=topology),
    }


def tensor_parallel_grid_case() -> dict:
    """Every getter of ``engine.grid`` on gpt-neox's topology with model=2, and the ranks of each group it returns."""
    import torch.distributed as dist

    import zeroshard
    from zeroshard.pipe import PipelineModule, PipeModelDataParallelTopology

    module = PipelineModule(specs(), topology=PipeModelDataParallelTopology(2, 2, 1), loss_fn=cross_entropy)
    engine, *_ = zeroshard.initialize(model=module, config=config(2, 1, tensor_parallel=TENSOR_PARALLEL))
    grid = engine.grid
    names = ("pipe_parallel", "data_parallel", "model_parallel", "slice_parallel", "tensor_model_parallel")
    out = {name: (getattr(grid, f"get_{name}_rank")(), getattr(grid, f"get_{name}_world_size")()) for name in names}
    for name in ("pipe_parallel", "data_parallel", "model_parallel", "slice_parallel"):
        try:
            out[f"{name}_group"] = sorted(dist.get_process_group_ranks(getattr(grid, f"get_{name}_group")()))
        except ValueError as error:  # a group of this rank alone has no process group (zeroshard's getters say so)
            out[f"{name}_group"] = str(error)
    out["stage_to_global"] = {(s, m): grid.stage_to_global(s, model=m) for s in range(2) for m in range(2)}
    topology = grid.topology()
    out["topology"] = (topology.get_axis_names(), [topology.get_dim(a) for a in ("pipe", "data", "model")])
    out["is_model_parallel"] = engine.is_model_parallel
    engine.destroy()
    return out


def eval_case(micro_batches: int, dual: bool = False) -> dict:
    """PP2 x DP2: eval_batch over ``micro_batches`` micro-batches (training uses 4), before and after one step.
    ``dual``: a DualPipeVModule, which also refuses an evaluation of fewer than 4 micro-batches."""
    import zeroshard
    from zeroshard.pipe import DualPipeVModule, PipelineModule

    module = (DualPipeVModule if dual else PipelineModule)(
        specs(), num_stages=2, loss_fn=cross_entropy, seed_layers=True
    )
    engine, *_ = zeroshard.initialize(model=module, config=config(4, 1))
    dp = engine.grid.get_data_parallel_rank()
    evaluation = global_batches(2, micro_batches, seed=5)[0]
    mine = evaluation[dp * micro_batches : (dp + 1) * micro_batches]
    refused = None
    if dual:
        try:
            engine.eval_batch(iter(mine), num_micro_batches=3)
        except ValueError as error:
            refused = str(error)
    before, logits = engine.eval_batch(iter(mine), return_logits=True, num_micro_batches=micro_batches)
    engine.train_batch(iter(global_batches(2, 4)[0][dp * 4 : (dp + 1) * 4]))
    after = engine.eval_batch(iter(mine), num_micro_batches=micro_batches)
    per_micro = engine.eval_batch(iter(mine), reduce_output=None, num_micro_batches=micro_batches)
    result = {
        "before": before.item(),
        "after": after.item(),
        "logits": None if logits is None else tuple(logits.shape),
        "per_micro": None if per_micro is None else len(per_micro),
        "stage": engine.stage_id,
        "refused": refused,
    }
    engine.destroy()
    return result


def failure_case(kind: str) -> str:
    """Run one hostile case; returns the error each rank raised, as 'Type: message'."""
    import zeroshard
    from zeroshard.pipe import DualPipeVModule, PipelineError, PipelineModule

    calls = {"n": 0}

    def failing_loss(out, labels):
        calls["n"] += 1
        if calls["n"] == 3:
            raise ValueError("loss_fn: labels out of range")
        return cross_entropy(out, labels)

    try:
        if kind == "stages_not_dividing":
            PipelineModule(specs(), num_stages=3)
        elif kind == "more_stages_than_layers":
            PipelineModule(specs()[:3], num_stages=4)
        elif kind == "not_a_module":
            PipelineModule([*specs(), 42], num_stages=2)
        elif kind == "layer_major":
            layer_major = {"stage": 3, "layer_major": True}
            zeroshard.initialize(
                model=PipelineModule(specs(), num_stages=2), config=config(2, 3, zero_optimization=layer_major)
            )
        elif kind == "megatron_split":
            module = PipelineModule(specs(), num_stages=2, loss_fn=cross_entropy)
            next(module.parameters()).tensor_model_parallel = True  # split by the client's own (Megatron) layers
            zeroshard.initialize(model=module, config=config(2, 1))
        elif kind == "tp_disagrees":
            from zeroshard.pipe import PipeModelDataParallelTopology

            topology = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1)
            module = PipelineModule(specs(), topology=topology, loss_fn=cross_entropy)
            tensor_parallel = {**TENSOR_PARALLEL, "autotp_size": 1}
            zeroshard.initialize(model=module, config=config(2, 1, tensor_parallel=tensor_parallel))
        elif kind == "sequence_axis":  # built for 2 sequence ranks per stage, run without sequence parallelism
            from zeroshard.pipe import ProcessTopology

            topology = ProcessTopology(["pipe", "data", "sequence"], [2, 1, 2])
            zeroshard.initialize(model=PipelineModule(specs(), topology=topology), config=config(2, 1))
        elif kind == "stages_mismatch":
            module = PipelineModule(specs(), num_stages=2, loss_fn=cross_entropy)
            zeroshard.initialize(model=module, config=config(2, 1, pipeline={"stages": 4}))
        elif kind.removeprefix("dualpipev_") in ("loss_fn", "short_iterator", "vector_loss"):
            dual, kind = kind.startswith("dualpipev_"), kind.removeprefix("dualpipev_")
            stages = 2 if kind == "short_iterator" else 4
            gas = 8 if dual and stages == 4 else 4

            def vector(out, labels):  # one loss per token: not a loss the engine can average
                return torch.nn.functional.cross_entropy(out.flatten(0, 1), labels.flatten(), reduction="none")

            loss_fn = {"loss_fn": failing_loss, "short_iterator": cross_entropy, "vector_loss": vector}[kind]
            module = (DualPipeVModule if dual else PipelineModule)(
                specs(), num_stages=stages, loss_fn=loss_fn, seed_layers=True
            )
            engine, *_ = zeroshard.initialize(model=module, config=config(gas, 1))
            data = global_batches(4 // stages, gas)[0][:gas]
            if kind == "short_iterator" and engine.global_rank == (1 if dual else 3):
                data = data[:2]  # the second pipeline's reader of labels runs out at micro-batch 2
            try:
                engine.train_batch(iter(data))
            except Exception as error:  # noqa: BLE001 - the error is the result; the engine refuses to go on
                try:
                    engine.train_batch(iter(data))
                except PipelineError as again:
                    assert "train_batch() after a failed batch of this engine" in str(again)
                    raise error from None
            finally:
                engine.destroy()
        else:
            raise AssertionError(kind)
    except Exception as error:  # noqa: BLE001 - the test reads every rank's error
        return f"{type(error).__name__}: {error}"
    return "no error"


FAILURES = ("stages_not_dividing", "more_stages_than_layers", "not_a_module", "layer_major", "stages_mismatch",
            "loss_fn", "short_iterator", "vector_loss", "megatron_split", "tp_disagrees", "sequence_axis",
            "dualpipev_loss_fn", "dualpipev_short_iterator")  # fmt: skip


def resume_case(
    ckpt_dir: str,
    stages: int,
    gas: int,
    save: bool = False,
    zero: int = 1,
    tag: str = "pp2",
    tp: int = 1,
    dual: bool = False,
    per_step: int = 4,
) -> dict:
    """``save``: PP2 x DP2 (or PP2 x TP2) trains 3 steps, saves, trains 2 more (the uninterrupted run); otherwise a
    run of ``stages`` stages and ``tp`` tensor-parallel ranks loads that checkpoint and trains the same 2 steps (the
    same ``per_step`` micro-batches per step: ``gas`` per data-parallel rank). ``zero``: the ZeRO stage of this run;
    ``dual``: a DualPipeVModule."""
    import zeroshard
    from zeroshard.pipe import DualPipeVModule, PipelineModule

    module = (DualPipeVModule if dual else PipelineModule)(
        specs(), num_stages=stages, loss_fn=cross_entropy, seed_layers=True
    )
    extra = {"tensor_parallel": {**TENSOR_PARALLEL, "autotp_size": tp}} if tp > 1 else {}
    engine, *_ = zeroshard.initialize(model=module, config=config(gas, zero, **extra))
    dp = engine.grid.get_data_parallel_rank()
    batches = global_batches(1, per_step)  # per_step micro-batches per step, whoever reads them
    out = {"stage": engine.stage_id}
    if save:
        for step in batches[:3]:
            engine.train_batch(iter(step[dp * gas : (dp + 1) * gas]))
        engine.save_checkpoint(ckpt_dir, tag=tag)
    else:
        engine.load_checkpoint(ckpt_dir, tag=tag)
        out["global_steps"] = engine.global_steps
    out["at_save"] = weights_of(module)
    out["losses"] = [engine.train_batch(iter(step[dp * gas : (dp + 1) * gas])).item() for step in batches[3:]]
    out["weights"] = weights_of(module)
    out["splits"], out["tp_rank"] = dict(engine.tensor_splits), engine.mesh.tensor.rank
    engine.destroy()
    return out


def grid_case(zero: dict) -> dict:
    """PP2 on 4 ranks: where each (stage, data-parallel rank) lives, and what ``grid.stage_to_global`` answers."""
    import zeroshard
    from zeroshard import comm
    from zeroshard.pipe import PipelineModule

    module = PipelineModule(specs(), num_stages=2, loss_fn=cross_entropy)
    engine, *_ = zeroshard.initialize(model=module, config=config(2, 1, zero_optimization=zero))
    grid = engine.grid
    table = torch.zeros(2 * comm.get_world_size(), dtype=torch.int64)
    mine = torch.tensor([grid.get_stage_id(), grid.get_data_parallel_rank()])
    comm.all_gather(table, mine, engine.mesh.world)
    where = {tuple(pair): rank for rank, pair in enumerate(table.view(-1, 2).tolist())}
    answers = {(s, d): grid.stage_to_global(s, data=d) for s in range(2) for d in range(2)}
    errors = []
    for bad in ({"data": 2}, {"data": -1}, {"data": True}, {"model": 0}):
        try:
            grid.stage_to_global(0, **bad)
        except ValueError as error:
            errors.append(str(error))
    engine.destroy()
    return {"where": where, "answers": answers, "errors": errors}


def _four_ranks(ckpt_dir: str) -> dict:
    out = {"resume": {"saved": resume_case(ckpt_dir, 2, 2, save=True)}}
    out["resume"]["pp4"] = resume_case(ckpt_dir, 4, 4)
    out["resume"]["pp1_dp4"] = resume_case(ckpt_dir, 1, 1)
    # saved under ZeRO-2, resumed under ZeRO-1 at 4 stages and under ZeRO-2 without a pipeline
    out["resume_zero2"] = {"saved": resume_case(ckpt_dir, 2, 2, save=True, zero=2, tag="pp2_zero2")}
    out["resume_zero2"]["pp4"] = resume_case(ckpt_dir, 4, 4, zero=1, tag="pp2_zero2")
    out["resume_zero2"]["pp1_dp4"] = resume_case(ckpt_dir, 1, 1, zero=2, tag="pp2_zero2")
    # saved at PP2 x TP2 (ZeRO-1), resumed at PP4, at TP2 x DP2 without a pipeline under ZeRO-2 (and in one process)
    # saved at PP2 x DP2 under ZeRO-3, resumed at PP4 under ZeRO-1 and at DP4 under ZeRO-3
    out["resume_zero3"] = {"saved": resume_case(ckpt_dir, 2, 2, save=True, zero=3, tag="pp2_zero3")}
    out["resume_zero3"]["pp4"] = resume_case(ckpt_dir, 4, 4, zero=1, tag="pp2_zero3")
    out["resume_zero3"]["pp1_dp4"] = resume_case(ckpt_dir, 1, 1, zero=3, tag="pp2_zero3")
    out["resume_zero3"]["pp2_tp2"] = resume_case(ckpt_dir, 2, 4, zero=1, tag="pp2_zero3", tp=2)
    out["resume_tp"] = {"saved": resume_case(ckpt_dir, 2, 4, save=True, tag="pp2_tp2", tp=2)}
    out["resume_tp"]["pp4"] = resume_case(ckpt_dir, 4, 4, tag="pp2_tp2")
    out["resume_tp"]["pp1_dp4"] = resume_case(ckpt_dir, 1, 2, zero=2, tag="pp2_tp2", tp=2)
    out["tensor_parallel"] = tensor_parallel_cases()
    out["experts"] = {stage: moe_case(stage, ckpt_dir if stage == 3 else None) for stage in (1, 3)}
    out["sequence"] = {stage: sequence_parallel_case(stage, ckpt_dir if stage == 3 else None) for stage in (1, 3)}
    out["loaded"] = {"pp2_ep2": load_case(ckpt_dir, "pp2_ep2", moe_specs(1))}
    out["loaded"]["pp2_sp2"] = load_case(ckpt_dir, "pp2_sp2", attention_specs())
    out["tensor_parallel_grid"] = tensor_parallel_grid_case()
    out["cases"] = {}
    for case in CASES_4:
        out["cases"][case] = train_case(*case)
    out["no_tie"] = train_case(2, 4, "uniform", 1, tied=False)
    out["checkpointed"] = train_case(2, 4, "parameters", 1, interval=1)
    out["checkpointed_zero3"] = train_case(4, 8, "uniform", 3, interval=1)  # recomputed in a backward after forwards
    out["plain"] = train_case(2, 4, "parameters", 1)
    out["checked"] = train_case(2, 4, "parameters", 1, extra={"gradient_check": {"enabled": True}})
    speculating = {"stage": 1, "offload_optimizer": {"device": "cpu", "super_offload": True}}
    out["speculated"] = train_case(2, 4, "parameters", 1, extra={"zero_optimization": speculating})
    out["grid"] = grid_case({"stage": 1})
    out["grid_replica"] = grid_case({"stage": 1, "mics_shard_size": 1})  # each stage: 2 replicas, no sharding
    out["eval"] = eval_case(3)
    out["gpt_neox"] = gpt_neox_case()
    out["failures"] = {kind: failure_case(kind) for kind in FAILURES}
    out["after_failures"] = train_case(4, 8, "uniform", 0)  # nothing a failed batch left behind reaches this run
    zero_bubble = {"pipeline": {"schedule": "zb-h1"}}
    out["zero_bubble"] = {case: train_case(*case, extra=zero_bubble) for case in ZERO_BUBBLE_CASES}
    out["zero_bubble_refused"] = refused_case(zero_bubble)
    out["time_partition"] = train_case(*TIME_CASE)
    out["dualpipev"] = {case: train_case(*case[:4], interval=case[4], dual=True) for case in DUALPIPEV_CASES}
    out["dualpipev_eval"] = eval_case(5, dual=True)
    out["dualpipev_refused"] = dualpipev_refused_case()
    out["dualpipev_compat"] = dualpipev_compat_case()
    out["interleaved"] = {case: train_case(*case[:4], stages_per_rank=case[4]) for case in INTERLEAVED_CASES}
    out["interleaved_eval"] = interleaved_eval_case()
    out["interleaved_refused"] = interleaved_refused_case()
    autotp = {"tensor_parallel": {**TENSOR_PARALLEL, "autotp_size": 2}}
    out["chunked_tensor_parallel"] = {  # PP2 x TP2: DualPipeV and interleaved (2 stages per rank), ZeRO-1
        "dualpipev": train_case(2, 4, "parameters", 1, extra=autotp, dual=True),
        "interleaved": train_case(2, 4, "uniform", 1, extra=autotp, stages_per_rank=2),
    }
    saved = resume_case(ckpt_dir, 2, 4, save=True, zero=2, tag="pp2_dualpipev", dual=True, per_step=8)
    out["resume_dualpipev"] = {"saved": saved}  # saved by DualPipeV at PP2 x DP2, resumed by 1F1B and DualPipeV at PP4
    out["resume_dualpipev"]["pp4"] = resume_case(ckpt_dir, 4, 8, tag="pp2_dualpipev", per_step=8)
    out["resume_dualpipev"]["pp4_dual"] = resume_case(ckpt_dir, 4, 8, tag="pp2_dualpipev", dual=True, per_step=8)
    return out


# (stages, gas, partition, ZeRO stage, activation checkpoint interval): DualPipeV with its B/W split (ZeRO 0-2, no
# checkpointing) at PP4 and PP2 x DP2, and without it (ZeRO-3 and activation checkpointing) at PP2 x DP2
DUALPIPEV_CASES = [(4, 8, "uniform", 0, 0), (2, 4, "parameters", 2, 0), (2, 4, "parameters", 3, 1)]


# (stages, gas, partition, ZeRO stage, stages per rank): interleaved 1F1B at PP4 (2 stages per rank, the tied embedding
# and head on ranks 0 and 3) and at PP2 x DP2 (3 per rank, ZeRO-2; then the tie's two copies are on ranks 0 and 1)
INTERLEAVED_CASES = [(4, 8, "uniform", 1, 2), (2, 4, "uniform", 2, 3)]


def interleaved_eval_case() -> dict:
    """eval_batch of an interleaved module at PP4 (forwards in the interleaved order), 4 micro-batches."""
    import zeroshard
    from zeroshard.pipe import PipelineModule

    module = PipelineModule(specs(), num_stages=4, loss_fn=cross_entropy, seed_layers=True, stages_per_rank=2)
    engine, *_ = zeroshard.initialize(model=module, config=config(4, 1))
    evaluation = global_batches(2, 2, seed=5)[0]
    loss = engine.eval_batch(iter(evaluation), num_micro_batches=4).item()
    engine.destroy()
    return {"loss": loss}


def interleaved_refused_case() -> list[str]:
    """What a module of 2 stages per rank says of 6 micro-batches on 4 ranks, and of another pipeline.schedule."""
    messages = []
    for gas, extra in ((6, {}), (8, {"pipeline": {"schedule": "zb-h1"}})):
        try:
            train_case(4, gas, "uniform", 1, extra=extra, stages_per_rank=2)
            messages.append("built")
        except ValueError as error:
            messages.append(str(error))
    return messages


def dualpipev_compat_case() -> dict:
    """DeepSpeed's spelling: ``deepspeed.pipe.DualPipeVModule`` through ``deepspeed.initialize`` (compat mode), PP4
    with 8 micro-batches; the engine is ``deepspeed.DualPipeVEngine``."""
    import zeroshard.compat.deepspeed as deepspeed
    from zeroshard.compat.deepspeed.pipe import DualPipeVModule

    module = DualPipeVModule(specs(), num_stages=4, loss_fn=cross_entropy, seed_layers=True, partition_method="uniform")
    engine, *_ = deepspeed.initialize(model=module, model_parameters=module.parameters(), config=config(8, 1))
    losses = [engine.train_batch(iter(step)).item() for step in global_batches(1, 8)]
    result = {"losses": losses, "engine": isinstance(engine, deepspeed.DualPipeVEngine), "weights": weights_of(module)}
    engine.destroy()
    return result


def dualpipev_refused_case() -> list[str]:
    """What a DualPipeVModule says of fewer than 2p micro-batches and of another pipeline.schedule."""
    messages = []
    for gas, extra in ((2, {}), (4, {"pipeline": {"schedule": "zb-h1"}})):
        try:
            train_case(2, gas, "parameters", 1, extra=extra, dual=True)
            messages.append("built")
        except ValueError as error:
            messages.append(str(error))
    return messages


ZERO_BUBBLE_CASES = [(4, 8, "uniform", 0), (2, 8, "parameters", 2)]  # (stages, gas, partition, ZeRO stage)
TIME_CASE = (4, 8, "time", 1)  # partition_method="time": each layer timed on one micro-batch, the ranks agreeing


def refused_case(extra: dict) -> list[str]:
    """What building ``extra``'s schedule says with ZeRO-3 and with activation checkpointing."""
    messages = []
    for stage, interval in ((3, 0), (1, 1)):
        try:
            train_case(2, 4, "parameters", stage, interval=interval, extra=extra)
            messages.append("built")
        except NotImplementedError as error:
            messages.append(str(error))
    return messages


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("pipeline_checkpoints"))


@pytest.fixture(scope="module")
def four(checkpoint_dir):
    return run_distributed(_four_ranks, 4, checkpoint_dir, timeout_s=600)


@pytest.mark.parametrize("layout", ["grid", "grid_replica"])
def test_stage_to_global_names_the_rank_at_that_stage_and_data_parallel_rank(four, layout):
    """DeepSpeed's ``grid.stage_to_global(stage, data=d)``: the rank whose grid says it is that stage's data-parallel
    rank ``d``, with or without a replica dimension (shard groups of one); an index out of range, or another
    coordinate, is a named error."""
    for result in four:
        grid = result[layout]
        assert grid["answers"] == grid["where"], grid
        assert len(grid["errors"]) == 4 and "data=2 is not an index below 2" in grid["errors"][0], grid["errors"]


@pytest.mark.parametrize("case", CASES_4)
def test_losses_and_weights_match_one_process(four, case):
    stages, gas, partition, zero = case
    dp = 4 // stages
    expected = reference(specs(), global_batches(dp, gas))
    for rank, result in enumerate(four):
        got = result["cases"][case]
        assert got["weights"], f"rank {rank} holds no parameters"
        # ZeRO-3 gathers its units within the stage in each micro-batch's forward and backward; ZeRO 0-2 after the step
        assert got["gathers"] >= 2 * gas if zero == 3 else got["gathers"] <= 4, (zero, got["gathers"])
        assert_like_one_process(got, expected, 1e-6 * 10, rank)


@pytest.mark.parametrize("case", ZERO_BUBBLE_CASES)
def test_the_zero_bubble_schedule_matches_one_process_holding_what_it_states(four, case):
    """ZB-H1 (``pipeline.schedule: "zb-h1"``): each backward split, the weight gradients deferred, the reductions
    (ZeRO-2 at PP2 x DP2) launched by the last micro-batch's weight pass; the same losses and weights as one process,
    every stage holding min(p, m) micro-batches at most (1F1B: p - s)."""
    stages, gas, _, _ = case
    expected = reference(specs(), global_batches(4 // stages, gas))
    for rank, result in enumerate(four):
        got = result["zero_bubble"][case]
        assert_like_one_process(got, expected, 1e-6 * 10, rank)
        assert got["peak"] == min(stages, gas), (case, got["stage"], got["peak"])
        one_f_one_b = result["cases"].get(case)
        if one_f_one_b is not None:
            assert one_f_one_b["peak"] == min(stages - one_f_one_b["stage"], gas)


@pytest.mark.parametrize("case", DUALPIPEV_CASES)
def test_dualpipev_matches_one_process_holding_what_it_states(four, case):
    """A DualPipeVModule (two stages per rank, the tied embedding and head one module on rank 0) runs DualPipeV: with
    the B/W split at ZeRO 0-2, DeepSpeed's plain order under ZeRO-3 with activation checkpointing; the same losses
    and weights as one process, every rank holding 2p + 1 chunks' activations at most (each chunk half a 1F1B
    stage's layers: p + 1/2 stages' worth, 1F1B's first stage p)."""
    stages, gas = case[:2]
    expected = reference(specs(), global_batches(4 // stages, gas))
    held = set()
    for rank, result in enumerate(four):
        got = result["dualpipev"][case]
        assert_like_one_process(got, expected, 1e-6 * 10, rank)
        assert got["peak"] == 2 * stages + 1, (case, got["stage"], got["peak"])
        held |= set(got["weights"])
        # both ends of the V on rank 0: the embedding and the head tied to it, one module there and nowhere else
        assert ("tied_modules.embed.weight" in got["weights"]) == (got["stage"] == 0)
        assert len(got["parts"]) == 2 * stages + 1
    assert held == set(expected["weights"])


@pytest.mark.parametrize("case", INTERLEAVED_CASES)
def test_interleaved_1f1b_matches_one_process_holding_what_it_states(four, case):
    """``stages_per_rank`` k: the model cut into k stages per rank, rank r running r, r + p, ...; interleaved 1F1B,
    the same losses and weights as one process; each rank holds at most 2 (p - r - 1) + (k - 1) p + 1 of its
    stages' activations (each 1/k of a 1F1B stage)."""
    stages, gas, _, _, per_rank = case
    expected = reference(specs(), global_batches(4 // stages, gas))
    held = set()
    for rank, result in enumerate(four):
        got = result["interleaved"][case]
        assert_like_one_process(got, expected, 1e-6 * 10, rank)
        s = got["stage"]
        assert got["peak"] == min(2 * (stages - s - 1) + (per_rank - 1) * stages + 1, per_rank * gas), (case, s)
        assert len(got["parts"]) == stages * per_rank + 1
        held |= set(got["weights"])
    assert held == set(expected["weights"])


def test_interleaved_1f1b_evaluates_as_one_process_and_refuses_what_it_cannot_run(four):
    from zeroshard.pipe import PipelineModule

    model = PipelineModule(specs(), num_stages=1, seed_layers=True, loss_fn=cross_entropy, partition_method="uniform")
    evaluation = global_batches(2, 2, seed=5)[0]
    with torch.no_grad():
        expected = (sum(cross_entropy(model(x), y) for x, y in evaluation) / len(evaluation)).item()
    for result in four:
        assert abs(result["interleaved_eval"]["loss"] - expected) <= 1e-6
        few, schedule = result["interleaved_refused"]
        assert "interleaved 1F1B (stages_per_rank 2) needs 2 or more pipeline ranks and gradient_accumulation_steps "
        assert "divisible by them: got 6 on 4 ranks" in few
        assert "pipeline.schedule 'zb-h1' with a PipelineModule of stages_per_rank 2: the module chooses" in schedule


@pytest.mark.parametrize("kind, messages", [("dualpipev", 2), ("interleaved", 3)])
def test_several_stages_per_rank_with_tensor_parallelism_match_one_process(four, kind, messages):
    """PP2 x TP2 with DualPipeV and interleaved 1F1B: each rank's pieces and the losses equal one process's; each
    tensor-parallel rank sends half of each activation and gradient, DualPipeV 2 and interleaved (k = 2) 3 messages
    per micro-batch and rank (the turn on DualPipeV's last rank sends nothing)."""
    expected = reference(specs(), global_batches(1, 4))
    half = MICRO * SEQ * DIM * 4 // 2
    for rank, result in enumerate(four):
        got = result["chunked_tensor_parallel"][kind]
        assert got["tp_rank"] == rank % 2 and got["splits"]
        assert_like_one_process(got, expected, 1e-6, rank, held=functools.partial(as_held, got))
        assert got["sent_between_stages"] == 4 * messages * (8 + half)


def test_deepspeeds_dualpipev_spelling_trains_as_one_process(four):
    expected = reference(specs(), global_batches(1, 8))
    for rank, result in enumerate(four):
        got = result["dualpipev_compat"]
        assert got["engine"]
        assert_like_one_process(got, expected, 1e-6 * 10, rank)


def test_dualpipev_evaluates_as_one_process_and_refuses_what_it_cannot_run(four):
    """eval_batch runs DualPipeV forward only (the loss on rank 0, which holds the model's last chunk); fewer than
    2p micro-batches, or a pipeline.schedule beside the module's, are refused by name on every rank."""
    before, after = eval_reference(5)
    for result in four:
        got = result["dualpipev_eval"]
        assert abs(got["before"] - before) <= 1e-6 and abs(got["after"] - after) <= 1e-5, (got, before, after)
        loss_rank = got["stage"] == 0
        assert got["logits"] == ((MICRO, SEQ, VOCAB) if loss_rank else None)
        assert got["per_micro"] == (5 if loss_rank else None)
        assert "DualPipeV needs at least 2 * 2 micro-batches (gradient_accumulation_steps) for 2" in got["refused"]
        few, schedule = result["dualpipev_refused"]
        assert "DualPipeV needs gradient_accumulation_steps >= 2 * 2 (two per pipeline rank), got 2" in few
        assert (
            "pipeline.schedule 'zb-h1' with a DualPipeVModule: the module chooses its schedule (DualPipeV" in schedule
        )


def test_a_dualpipev_checkpoint_resumes_under_1f1b_and_dualpipev_at_another_stage_count(four):
    """Saved by DualPipeV at PP2 x DP2 (ZeRO-2): every stage's parameters under the whole model's names, so 1F1B and
    DualPipeV at PP4 load it exactly and continue as the run that went on."""
    saved_runs = [r["resume_dualpipev"]["saved"] for r in four]
    saved = {n: t for run in saved_runs for n, t in run["at_save"].items()}
    uninterrupted = {n: t for run in saved_runs for n, t in run["weights"].items()}
    assert set(saved) == set(reference(specs(), global_batches(1, 1))["weights"])
    for layout in ("pp4", "pp4_dual"):
        for result in four:
            run = result["resume_dualpipev"][layout]
            assert run["global_steps"] == 3
            for name, value in run["at_save"].items():
                assert torch.equal(value, saved[name]), (layout, name)
            assert max(abs(a - b) for a, b in zip(run["losses"], saved_runs[0]["losses"])) <= 1e-6, layout
            for name, value in run["weights"].items():
                torch.testing.assert_close(value, uninterrupted[name], rtol=1e-6, atol=1e-6, msg=name)


def test_a_partition_by_measured_time_is_agreed_on_by_every_rank_and_exact(four):
    """Each rank times the layers itself; the averaged times split the model alike on all of them (a stage per layer
    run at least), and the model trains as one process."""
    expected = reference(specs(), global_batches(1, 8))
    parts = {tuple(result["time_partition"]["parts"]) for result in four}
    assert len(parts) == 1 and all(b - a >= 1 for a, b in zip(next(iter(parts)), next(iter(parts))[1:])), parts
    for rank, result in enumerate(four):
        assert_like_one_process(result["time_partition"], expected, 1e-6 * 10, rank)


def test_the_zero_bubble_schedule_refuses_zero3_and_activation_checkpointing_by_name(four):
    for result in four:
        zero3, checkpointed = result["zero_bubble_refused"]
        assert "pipeline.schedule 'zb-h1' with zero_optimization.stage 3 is not implemented" in zero3
        assert "'zb-h1' with activation checkpointing (activation_checkpoint_interval 1)" in checkpointed


def test_the_offloaded_step_during_backward_leaves_tied_layers_to_the_step(four):
    """``super_offload`` on a pipeline with a tied embedding: the tie's gradient is summed over the stages after
    backward, so its flat group is stepped after the verdict; the rest are speculated. Equal to one process, and
    the tied copies equal on both stages."""
    expected = reference(specs(), global_batches(2, 4))
    for rank, result in enumerate(four):
        got = result["speculated"]
        assert_like_one_process(got, expected, 1e-5, rank)
    firsts, lasts = four[0]["speculated"]["tied"], four[-1]["speculated"]["tied"]
    assert all(torch.equal(a, b) for a, b in zip(firsts, lasts))


def test_bytes_between_stages_are_the_analytic_count(four):
    """Per micro-batch, a stage sends the next its activation (MICRO x SEQ x DIM fp32) after a word (0: the
    announcement sent before still holds; the first step sent it: 3 + 3 + 3 int64 fields for one 3-D tensor), and the
    previous one the gradient after a status word."""
    activation = MICRO * SEQ * DIM * 4
    for case in CASES_4:
        stages, gas = case[0], case[1]
        for result in four:
            stage = result["cases"][case]["stage"]
            forward = (8 + activation) if stage < stages - 1 else 0
            backward = (8 + activation) if stage > 0 else 0
            assert result["cases"][case]["sent_between_stages"] == gas * (forward + backward), (case, stage)


def test_tied_embedding_stays_equal_on_the_stages_holding_it(four):
    for case in CASES_4:
        holders = [r["cases"][case]["tied"] for r in four if r["cases"][case]["tied"]]
        assert len(holders) >= 2, case  # the first and last stages
        for step in range(STEPS):
            for other in holders[1:]:
                assert torch.equal(holders[0][step], other[step]), (case, step)


def test_untied_head_matches_one_process(four):
    expected = reference(specs(tied=False), global_batches(2, 4))
    for rank, result in enumerate(four):
        assert_like_one_process(result["no_tie"], expected, 1e-5, rank)


def test_the_runtime_gradient_check_runs_on_every_stage_without_a_false_alarm(four):
    for result in four:
        assert result["checked"]["losses"] == result["plain"]["losses"]


def test_zero3_recomputes_checkpointed_layers_inside_backward_after_other_forwards(four):
    """ZeRO-3 with activation checkpointing at PP4 x 8 micro-batches: 1F1B runs micro-batch k's backward after later
    forwards, and its recomputed layers gather what those left freed; equal to one process."""
    expected = reference(specs(), global_batches(1, 8))
    for rank, result in enumerate(four):
        got = result["checkpointed_zero3"]
        assert_like_one_process(got, expected, 1e-6, rank)


def test_activation_checkpointing_inside_stages_is_bit_identical(four):
    for result in four:
        assert result["checkpointed"]["losses"] == result["plain"]["losses"]
        for name, value in result["plain"]["weights"].items():
            assert torch.equal(result["checkpointed"]["weights"][name], value), name


def test_partitions_place_layers_as_deepspeed(four):
    from zeroshard.pipe import partition_balanced

    parts = {case: four[0]["cases"][case]["parts"] for case in CASES_4}
    block = 2 * DIM + (DIM * 2 * DIM + 2 * DIM) + (2 * DIM * DIM + DIM)  # norm, fc, out
    counts = [VOCAB * DIM, *[block] * 6, 2 * DIM, VOCAB * DIM]  # each tied spec counted where it appears
    assert parts[(4, 1, "parameters", 1)] == partition_balanced(counts, 4) == [0, 2, 4, 6, 9]
    assert parts[(4, 8, "uniform", 0)] == [0, 3, 5, 7, 9]
    assert parts[(2, 1, "type:block", 1)] == [0, 4, 9]
    assert all(math.isfinite(x) for r in four for x in r["cases"][CASES_4[0]]["losses"])


def eval_reference(micro_batches: int) -> tuple[float, float]:
    """One process: the evaluation loss before and after one training step."""
    from zeroshard.pipe import PipelineModule

    model = PipelineModule(specs(), num_stages=1, seed_layers=True, loss_fn=cross_entropy, partition_method="uniform")
    evaluation = global_batches(2, micro_batches, seed=5)[0]

    def loss() -> float:
        with torch.no_grad():
            return (sum(cross_entropy(model(x), y) for x, y in evaluation) / len(evaluation)).item()

    before = loss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    batch = global_batches(2, 4)[0]
    (sum(cross_entropy(model(x), y) for x, y in batch) / len(batch)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    optimizer.step()
    return before, loss()


def test_eval_batch_with_other_micro_batch_counts_equals_one_process(four):
    before, after = eval_reference(3)
    for result in four:
        got = result["eval"]
        assert abs(got["before"] - before) <= 1e-6 and abs(got["after"] - after) <= 1e-5, (got, before, after)
        last = got["stage"] == 1
        assert got["logits"] == ((MICRO, SEQ, VOCAB) if last else None)
        assert got["per_micro"] == (3 if last else None)


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("stages_not_dividing", ["ValueError: num_stages 3 must divide the number of ranks 4"] * 4),
        ("more_stages_than_layers", ["ValueError: PipelineModule: 3 layers cannot fill 4 pipeline stages"] * 4),
        ("not_a_module", ["TypeError: PipelineModule layer 9 is int"] * 4),
        ("layer_major", ["NotImplementedError: zero_optimization.layer_major with a PipelineModule"] * 4),
        (
            "megatron_split",
            [
                "NotImplementedError: the PipelineModule's parameter tied_modules.embed.weight is marked "
                "tensor_model_parallel"
            ]
            * 4,
        ),
        (
            "tp_disagrees",
            [
                "ValueError: the tensor-parallel size disagrees: the PipelineModule's topology has model= 2; the "
                "config's tensor_parallel.autotp_size is 1"
            ]
            * 4,
        ),
        (
            "sequence_axis",
            ["ValueError: the PipelineModule's topology has sequence=2 but the sequence-parallel size is 1"] * 4,
        ),
        (
            "stages_mismatch",
            ["ValueError: the config's pipeline.stages is 4 but the PipelineModule was built with 2"] * 4,
        ),
        (
            "loss_fn",
            ["StageAborted: rank 0 (pipeline stage 0): stopped waiting for gradients from rank 1: rank 3 failed"]
            + ["StageAborted: rank 1 (pipeline stage 1): stopped waiting for gradients from rank 2: rank 3 failed"]
            + ["StageAborted: rank 2 (pipeline stage 2): stopped waiting for gradients from rank 3: rank 3 failed"]
            + ["ValueError: loss_fn: labels out of range"],
        ),
        (
            "vector_loss",
            ["StageAborted: rank 0 (pipeline stage 0): stopped waiting for gradients from rank 1: rank 3 failed"]
            + ["StageAborted: rank 1 (pipeline stage 1): stopped waiting for gradients from rank 2: rank 3 failed"]
            + ["StageAborted: rank 2 (pipeline stage 2): stopped waiting for gradients from rank 3: rank 3 failed"]
            + ["PipelineError: rank 3: the last stage's loss must be a one-element tensor, got (12,)"],
        ),
        (
            "short_iterator",
            ["StageAborted: rank 0 (pipeline stage 0): stopped waiting for gradients from rank 2: rank 3 failed"]
            + ["StageAborted: rank 1 (pipeline stage 0): stopped waiting for gradients from rank 3: rank 3 failed"]
            + ["StageAborted: rank 2 (pipeline stage 1): stopped before reducing gradients: rank 3 (pipeline stage 1)"]
            + ["PipelineDataExhausted: rank 3 (pipeline stage 1): the data iterator ended at micro-batch 2 of 4"],
        ),
        (  # DualPipeV: rank 0 holds the loss; its word reaches rank 1 on whichever of its two channels it reads
            "dualpipev_loss_fn",
            ["ValueError: loss_fn: labels out of range"]
            + ["StageAborted: rank 1 (pipeline stage 1): stopped waiting for gradients from rank 0: rank 0 failed"]
            + ["StageAborted: rank 2 (pipeline stage 2): stopped waiting for activations from rank 1: rank 0 failed"]
            + ["StageAborted: rank 3 (pipeline stage 3): stopped waiting for activations from rank 2: rank 0 failed"],
        ),
        (  # DualPipeV at PP2 x DP2: rank 1 (stage 0 of the second pipeline) reads the data
            "dualpipev_short_iterator",
            ["StageAborted: rank 0 (pipeline stage 0): stopped before reducing gradients: rank 1 (pipeline stage 0)"]
            + ["PipelineDataExhausted: rank 1 (pipeline stage 0): the data iterator ended at micro-batch 2 of 4"]
            + ["StageAborted: rank 2 (pipeline stage 1): stopped before reducing gradients: rank 1 (pipeline stage 0)"]
            + ["StageAborted: rank 3 (pipeline stage 1): stopped waiting for activations from rank 1: rank 1 failed"],
        ),
    ],
)
def test_failures_are_named_errors_on_every_rank(four, kind, expected):
    for rank, (result, start) in enumerate(zip(four, expected)):
        assert result["failures"][kind].startswith(start), (rank, result["failures"][kind])


def test_a_run_after_failures_is_exact(four):
    expected = reference(specs(), global_batches(1, 8))
    for result in four:
        got = result["after_failures"]
        assert max(abs(a - b) for a, b in zip(got["losses"], expected["losses"])) <= 1e-5


# -- DeepSpeed's clients, in their own shape (compat mode: ``import deepspeed`` is zeroshard's) ------------------------


def manual_pipeline_module_class():
    """diffusion-pipe's ``ManualPipelineModule`` in outline: a subclass setting an attribute before the base class's
    construction and overriding ``_partition_layers`` with a ``manual`` split, reading DeepSpeed's private names."""
    from zeroshard.compat.deepspeed.pipe import PipelineModule

    class ManualPipelineModule(PipelineModule):
        def __init__(self, *args, manual_partition_split=None, **kwargs):
            self.manual_partition_split = manual_partition_split
            super().__init__(*args, **kwargs)

        def _partition_layers(self, method="uniform"):
            if method.lower() == "manual" and self.manual_partition_split is not None:
                stage_id = self._topo.get_coord(self.global_rank).pipe
                assert len(self.manual_partition_split) == self._topo.get_dim("pipe") - 1
                self.parts = [0, *self.manual_partition_split, len(self._layer_specs)]
                self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])
            else:
                super()._partition_layers(method)

    return ManualPipelineModule


def diffusion_pipe_case(gas: int = 4) -> dict:
    """The loop diffusion-pipe runs (train.py), on 3 stages exchanging mixed-dtype tuples, split by hand."""
    import zeroshard.compat.deepspeed as deepspeed

    module = manual_pipeline_module_class()(
        layers=tuple_specs(),
        num_stages=3,
        partition_method="manual",
        manual_partition_split=[1, 3],
        loss_fn=cross_entropy,
        seed_layers=True,
    )
    model_engine, optimizer, _, _ = deepspeed.initialize(model=module, config=config(gas, 1))
    model_engine._support_torch_style_backward = True
    grid = model_engine.grid
    global_batch = model_engine.train_micro_batch_size_per_gpu() * model_engine.gradient_accumulation_steps()
    global_batch *= grid.get_data_parallel_world_size()
    facts = {
        "global_batch": global_batch,
        "is_pipe_parallel": model_engine.is_pipe_parallel,
        "last_stage_rank": grid.stage_to_global(model_engine.num_stages - 1),
        "pp_group": list(grid.pp_group),
        "pipe_rank": grid.get_pipe_parallel_rank(),
        "parts": module.parts,
        "first_last": (model_engine.is_first_stage(), model_engine.is_last_stage()),
    }
    losses = []
    for step_batches in global_batches(1, gas):
        model_engine.reset_activation_shape()
        losses.append(model_engine.train_batch(iter(step_batches)).item())
    model_engine.reset_activation_shape()
    evaluation = model_engine.eval_batch(iter(global_batches(1, 2, seed=9)[0]), num_micro_batches=2).item()
    weights = {n: p.detach().clone() for n, p in module.named_parameters()}
    model_engine.destroy()
    return {"losses": losses, "weights": weights, "facts": facts, "eval": evaluation}


def _three_ranks() -> dict:
    return {"tuples": train_tuples(3, 4), "diffusion_pipe": diffusion_pipe_case()}


def train_tuples(stages: int, gas: int) -> dict:
    import zeroshard
    from zeroshard.pipe import PipelineModule

    module = PipelineModule(tuple_specs(), num_stages=stages, loss_fn=cross_entropy, seed_layers=True)
    engine, *_ = zeroshard.initialize(model=module, config=config(gas, 1))
    losses = [engine.train_batch(iter(b)).item() for b in global_batches(1, gas)]
    weights = {n: p.detach().clone() for n, p in module.named_parameters()}
    engine.destroy()
    return {"losses": losses, "weights": weights}


@pytest.fixture(scope="module")
def three():
    return run_distributed(_three_ranks, 3, timeout_s=600)


@pytest.mark.parametrize("case", ["tuples", "diffusion_pipe"])
def test_three_stages_exchanging_mixed_dtype_tuples_match_one_process(three, case):
    expected = reference(tuple_specs(), global_batches(1, 4))
    for rank, result in enumerate(three):
        got = result[case]
        assert_like_one_process(got, expected, 1e-5, rank)


def test_diffusion_pipe_reads_the_engine_as_it_does_on_deepspeed(three):
    for rank, result in enumerate(three):
        facts = result["diffusion_pipe"]["facts"]
        assert facts["global_batch"] == MICRO * 4 and facts["is_pipe_parallel"]
        assert facts["last_stage_rank"] == 2 and facts["pp_group"] == [0, 1, 2] and facts["pipe_rank"] == rank
        assert facts["parts"] == [0, 1, 3, 6] and facts["first_last"] == (rank == 0, rank == 2)
    losses = {round(r["diffusion_pipe"]["eval"], 6) for r in three}
    assert len(losses) == 1  # the eval loss is broadcast to every stage


class EmbeddingPipe(nn.Module):
    """gpt-neox's embedding in outline: (input ids, position ids, attention mask) in, (hidden, mask) out; the tied
    head reads ``word_embeddings_weight``."""

    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden)

    @property
    def word_embeddings_weight(self):
        return self.word_embeddings.weight

    def forward(self, args):
        input_ids, position_ids, attention_mask = args
        return self.word_embeddings(input_ids) + 0.01 * position_ids.unsqueeze(-1), attention_mask


class ParallelTransformerLayerPipe(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.block = Block(hidden)
        self.mix = nn.Linear(hidden, hidden)

    def forward(self, args):
        hidden, mask = args  # mask: bool (1, 1, S, S), causal
        weights = torch.where(mask[0, 0], 0.0, 1.0) / torch.arange(1, hidden.shape[1] + 1).unsqueeze(-1)
        return self.block(hidden) + weights @ self.mix(hidden), mask


def masked_cross_entropy(output, labels):
    labels, loss_mask = labels
    losses = torch.nn.functional.cross_entropy(
        output.reshape(-1, output.shape[-1]), labels.reshape(-1), reduction="none"
    )
    return (losses * loss_mask.reshape(-1)).sum() / loss_mask.sum()


def gpt2_model_pipe_class():
    """gpt-neox's ``GPT2ModelPipe`` in outline: its own ``specs`` list, built before the base class's construction
    and extended by ``insert_layers`` (which constructs the base class again), the tied embedding as the head through
    ``forward_fn`` and ``tied_weight_attr``, plain callables between layers, a ``type:`` partition and
    ``checkpointable_layers``."""
    from functools import partial

    from zeroshard.compat.deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    class GPT2ModelPipe(PipelineModule):
        def __init__(self, topology, layers: int = 4):
            self.__topology__ = topology
            self.num_layers = layers
            self.specs = []
            self.init_specs()
            super().__init__(
                layers=self.specs,
                loss_fn=partial(masked_cross_entropy),
                topology=topology,
                activation_checkpoint_interval=1,
                partition_method="type:transformer|mlp",
                checkpointable_layers=["GMLPBlock", "ParallelTransformerLayerPipe"],
            )

        def insert_layers(self, layers, idx):
            self.specs[idx:idx] = layers
            super().__init__(
                layers=self.specs,
                loss_fn=self.loss_fn,
                topology=self.__topology__,
                activation_checkpoint_interval=self.activation_checkpoint_interval,
                partition_method="type:transformer|mlp",
                checkpointable_layers=["GMLPBlock", "ParallelTransformerLayerPipe"],
            )

        def init_specs(self):
            self.specs = [TiedLayerSpec("embed", EmbeddingPipe, DIM, VOCAB, tied_weight_attr="word_embeddings_weight")]
            self.specs.append(lambda args: args)  # _pre_transformer_block
            self.specs += [LayerSpec(ParallelTransformerLayerPipe, DIM) for _ in range(self.num_layers)]
            self.specs.append(lambda args: args[0])  # _post_transformer_block: drop the mask
            self.specs.append(LayerSpec(Norm, DIM))

            def _logits_helper(embedding, lm_output):
                return lm_output @ embedding.word_embeddings_weight.t()

            self.specs.append(
                TiedLayerSpec(
                    "embed",
                    EmbeddingPipe,
                    DIM,
                    VOCAB,
                    forward_fn=_logits_helper,
                    tied_weight_attr="word_embeddings_weight",
                )
            )

    return GPT2ModelPipe


def neox_batch(data: dict):
    """gpt-neox's ``get_batch_pipe`` in outline: a dict of token rows to ((tokens, positions, mask), (labels, loss
    mask))."""
    tokens = data["text"]
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(ids.shape[1]).expand_as(ids).float()
    mask = torch.triu(torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool), diagonal=1)[None, None]
    return (ids, positions, mask), (labels, (labels % 5 != 0).float())


def neox_data(dp: int, gas: int, seed: int = 11) -> list[list[dict]]:
    g = torch.Generator().manual_seed(seed)
    return [
        [{"text": torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=g)} for _ in range(dp * gas)]
        for _ in range(STEPS)
    ]


def build_neox(topology):
    model = gpt2_model_pipe_class()(topology)
    model.insert_layers([lambda args: args], 1)  # a soft-prompt-like callable, as gpt-neox's insert_layers adds
    return model


def gpt_neox_case(gas: int = 4) -> dict:
    """gpt-neox's loop in outline: PipeModelDataParallelTopology, set_batch_fn, train_batch(data_iter=...),
    eval_batch(data_iter, return_logits=True); weights start from the one-process model's (by name)."""
    import zeroshard.compat.deepspeed as deepspeed
    from zeroshard.compat.deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    torch.manual_seed(0)
    whole = build_neox(PipeModelDataParallelTopology(num_pp=1, num_mp=1, num_dp=4))
    model = build_neox(PipeModelDataParallelTopology(num_pp=2, num_mp=1, num_dp=2))
    start = dict(whole.named_parameters())
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(start[name])
    engine, *_ = deepspeed.initialize(model=model, config=config(gas, 1))
    engine.set_batch_fn(neox_batch)
    dp = engine.grid.get_data_parallel_rank()
    losses = [engine.train_batch(data_iter=iter(b[dp * gas : (dp + 1) * gas])).item() for b in neox_data(2, gas)]
    loss, logits = engine.eval_batch(
        iter(neox_data(2, 1, seed=12)[0][dp : dp + 1]), return_logits=True, num_micro_batches=1
    )
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    result = {"losses": losses, "weights": weights, "parts": model.parts, "eval": loss.item()}
    result["logits"] = None if logits is None else tuple(logits.shape)
    engine.destroy()
    return result


def neox_reference(gas: int = 4) -> dict:
    from zeroshard.compat.deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    torch.manual_seed(0)
    model = build_neox(PipeModelDataParallelTopology(num_pp=1, num_mp=1, num_dp=1))  # as the ranks build it
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for step in neox_data(2, gas):
        optimizer.zero_grad()
        total = sum(masked_cross_entropy(model(x), y) for x, y in map(neox_batch, step)) / len(step)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        losses.append(total.item())
    with torch.no_grad():
        evaluation = [masked_cross_entropy(model(x), y).item() for x, y in map(neox_batch, neox_data(2, 1, seed=12)[0])]
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "weights": weights, "eval": sum(evaluation) / len(evaluation)}


def test_gpt_neox_model_pipe_trains_as_one_process(four):
    expected = neox_reference()
    for rank, result in enumerate(four):
        got = result["gpt_neox"]
        assert got["parts"] == [0, 5, 10]  # type:transformer|mlp: layers 3-6 match, 2 per stage
        assert_like_one_process(got, expected, 1e-5, rank)
        assert abs(got["eval"] - expected["eval"]) <= 1e-5
        assert got["logits"] == ((MICRO, SEQ, VOCAB) if rank >= 2 else None)


def _one_process(ckpt_dir: str, tag: str) -> dict:
    return resume_case(ckpt_dir, 1, 4, tag=tag)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_a_checkpoint_resumes_at_other_stage_counts_data_parallel_degrees_and_one_process(four, checkpoint_dir, zero):
    """Saved at PP2 x DP2 (ZeRO-1; or ZeRO-2 / ZeRO-3, resumed under ZeRO-1 at PP4 and under the same stage at DP4,
    and the ZeRO-3 one under ZeRO-1 at PP2 x TP2); loaded at PP4, at DP4 without a pipeline and in one process, each
    continues as the run that went on (a tensor-parallel rank holding its pieces of it)."""
    from zeroshard.checkpoint import get_fp32_state_dict_from_zero_checkpoint

    key, tag = {1: ("resume", "pp2"), 2: ("resume_zero2", "pp2_zero2"), 3: ("resume_zero3", "pp2_zero3")}[zero]
    saved = {n: t for r in four for n, t in r[key]["saved"]["at_save"].items()}  # every stage's parameters
    uninterrupted = {n: t for r in four for n, t in r[key]["saved"]["weights"].items()}
    losses = four[0][key]["saved"]["losses"]
    layouts = ("pp4", "pp1_dp4", "pp2_tp2") if zero == 3 else ("pp4", "pp1_dp4")
    runs = [r[key][layout] for layout in layouts for r in four]
    runs += run_distributed(_one_process, 1, checkpoint_dir, tag)
    for run in runs:
        assert run["global_steps"] == 3
        for name, value in run["at_save"].items():
            assert torch.equal(value, as_held(run, saved, name)), name  # weights exact after the load
        assert max(abs(a - b) for a, b in zip(run["losses"], losses)) <= 1e-6, (run["losses"], losses)
        for name, value in run["weights"].items():
            torch.testing.assert_close(value, as_held(run, uninterrupted, name), rtol=1e-6, atol=1e-6, msg=name)
    consolidated = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=tag)
    assert set(consolidated) == set(saved)
    for name, value in consolidated.items():
        assert torch.equal(value, saved[name]), name


def whole(runs: list[dict]) -> dict:
    """The whole model's tensors from the runs of every rank: tensor-parallel pieces joined in rank order."""
    pieces: dict = {}
    for run in runs:
        for name, value in run["weights"].items():
            split = run["splits"].get(name)
            pieces.setdefault(name, {})[run["tp_rank"] if split is not None else 0] = (value, split)
    out = {}
    for name, by_rank in pieces.items():
        split = by_rank[0][1]
        if split is None:
            out[name] = by_rank[0][0]
            continue
        assert split.fused == 1 and not split.transposed, (name, split)
        out[name] = torch.cat([by_rank[r][0] for r in sorted(by_rank)], split.dim)
    return out


def as_held(run: dict, full: dict, name: str) -> torch.Tensor:
    """What ``run`` holds of the whole tensor ``full[name]``: its piece when split there."""
    split = run["splits"].get(name)
    return full[name] if split is None else split.piece(full[name], run["tp_rank"])


@pytest.mark.parametrize("route", ["autotp", "topology", "zero3"])
def test_pipeline_with_tensor_parallelism_matches_one_process(four, route):
    """PP2 x TP2: each stage's blocks split over its 2 tensor-parallel ranks (fc column-, out row-parallel), through
    ``num_stages`` + ``autotp_size`` under ZeRO-1 and ZeRO-3 and through gpt-neox's topology under ZeRO-2: the losses
    and every rank's pieces equal one process's."""
    expected = reference(specs(), global_batches(1, 4))
    for rank, result in enumerate(four):
        got = result["tensor_parallel"][route]
        assert got["tp_rank"] == rank % 2 and got["stage"] == rank // 2
        assert len(got["splits"]) == 9, sorted(got["splits"])  # 3 blocks a stage: fc weight and bias, out weight
        assert_like_one_process(got, expected, 1e-6, rank, held=functools.partial(as_held, got))  # its pieces


def test_tensor_parallel_ranks_send_slices_between_stages_and_gather_the_same_values(four):
    """``pipeline.pipe_partitioned`` / ``grad_partitioned`` (DeepSpeed's defaults, on): each of a stage's 2
    tensor-parallel ranks sends half of each activation and input gradient (plus the status word), the receiving
    stage gathers the halves; the run is bit for bit the run that sends them whole (both off)."""
    activation = MICRO * SEQ * DIM * 4
    for result in four:
        sliced, whole = result["tensor_parallel"]["autotp"], result["tensor_parallel"]["whole"]
        assert sliced["losses"] == whole["losses"]
        assert all(torch.equal(value, whole["weights"][name]) for name, value in sliced["weights"].items())
        assert sliced["sent_between_stages"] == 4 * (8 + activation // 2)  # 4 micro-batches, one direction a stage
        assert whole["sent_between_stages"] == 4 * (8 + activation)


@pytest.mark.parametrize("stage", [1, 3])
def test_pipeline_with_expert_parallelism_matches_one_process(four, stage):
    """PP2 x DP2 with DeepSpeed's MoE layer (4 experts, ep_size 2) in half the blocks, under ZeRO-1 and ZeRO-3: each
    stage's data-parallel ranks split its experts and exchange tokens; the losses and every rank's experts (its 2
    of the one process's 4) equal one process's."""
    expected = reference(moe_specs(1), global_batches(2, 4))
    for rank, result in enumerate(four):
        got = result["experts"][stage]
        assert got["experts"] == 2 and got["expert_rank"] == rank % 2
        assert any(".deepspeed_experts." in name for name in got["weights"])

        def held(weights, name, expert_rank=got["expert_rank"]):
            return weights[as_one_process_names(name, expert_rank)]

        assert_like_one_process(got, expected, 1e-6, rank, held=held)


@pytest.mark.parametrize("stage", [1, 3])
def test_pipeline_with_sequence_parallelism_matches_one_process(four, stage):
    """PP2 x SP2 under ZeRO-1 and ZeRO-3: each stage's 2 ranks hold half of every sequence, attention trades tokens
    for heads over them (DeepSpeed's ``DistributedAttention``), and the last stage's loss is token-weighted over them
    (a piece with no counted token included); the losses and every stage's weights equal one process's on whole
    sequences. The grid's topology shows the sequence axis between data and model."""
    expected = reference(attention_specs(), sequence_parallel_batches())
    for rank, result in enumerate(four):
        got = result["sequence"][stage]
        assert (got["stage"], got["sequence_rank"]) == divmod(rank, 2)
        assert got["axes"] == ["pipe", "data", "sequence"] and got["dims"] == [2, 1, 2]
        assert any(".qkv." in name for name in got["weights"])
        assert_like_one_process(got, expected, 1e-6, rank)
        # per attention layer and micro-batch: q, k, v and the output out and their gradients back, each a rank's
        # piece (2 sequences of SEQ / 2 tokens, all heads) in fp32
        per_layer = 2 * 4 * (MICRO * SEQ // 2 * DIM * 4)
        assert got["all_to_all"] == per_layer * 4 * got["attention_layers"] > 0, got


@pytest.mark.parametrize("saved", ["pp2_ep2", "pp2_sp2"])
def test_expert_and_sequence_parallel_pipelines_load_at_four_stages(four, checkpoint_dir, saved):
    """Saved at PP2 x DP2 x EP2 and at PP2 x SP2 (both ZeRO-3), loaded at PP4 under ZeRO-1 with neither axis: each
    stage holds exactly what the saving run ended with (the experts of both expert ranks, in order), and the
    consolidated checkpoint is that whole model."""
    from zeroshard.checkpoint import get_fp32_state_dict_from_zero_checkpoint

    if saved == "pp2_ep2":  # the saving ranks' experts, as one process numbers them
        ended = {}
        for result in four:
            got = result["experts"][3]
            ended.update({as_one_process_names(n, got["expert_rank"]): t for n, t in got["weights"].items()})
    else:
        ended = {n: t for result in four for n, t in result["sequence"][3]["weights"].items()}
    for result in four:
        loaded = result["loaded"][saved]
        assert loaded["global_steps"] == STEPS
        for name, value in loaded["weights"].items():
            assert torch.equal(value, ended[name]), name
    consolidated = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=saved)
    assert set(consolidated) == set(ended)
    for name, value in consolidated.items():
        assert torch.equal(value, ended[name]), name


def test_the_grid_answers_as_deepspeeds_grid_on_the_same_topology(four):
    """``engine.grid`` on ``PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1)``: each getter is what
    DeepSpeed's ``PipelineParallelGrid`` computes from that topology (its model-parallel group: the ranks of one
    data-parallel index; its slice group: the model axis)."""
    from zeroshard.pipe import PipeModelDataParallelTopology

    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1)
    for rank, result in enumerate(four):
        got, coord = result["tensor_parallel_grid"], topo.get_coord(rank)
        model_group = sorted(topo.get_axis_list("data", coord.data))
        assert got["pipe_parallel"] == (coord.pipe, topo.get_dim("pipe"))
        assert got["data_parallel"] == (coord.data, topo.get_dim("data"))
        assert got["model_parallel"] == (model_group.index(rank), len(model_group))
        assert got["slice_parallel"] == got["tensor_model_parallel"] == (coord.model, topo.get_dim("model"))
        assert got["model_parallel_group"] == model_group
        assert got["pipe_parallel_group"] == next(g for g in topo.get_axis_comm_lists("pipe") if rank in g)
        assert got["slice_parallel_group"] == next(g for g in topo.get_axis_comm_lists("model") if rank in g)
        assert f"the batch group is rank {rank} alone" in got["data_parallel_group"]
        for (stage, model), answer in got["stage_to_global"].items():
            assert answer == topo.get_rank(**coord._replace(pipe=stage, model=model)._asdict())
        assert got["topology"] == (["pipe", "data", "model"], [2, 1, 2]) and got["is_model_parallel"]


def test_a_checkpoint_saved_with_tensor_parallelism_resumes_at_other_layouts(four, checkpoint_dir):
    """Saved at PP2 x TP2 (ZeRO-1); loaded at PP4 without tensor parallelism, at TP2 x DP2 without a pipeline under
    ZeRO-2 and in one process: each holds exactly what was saved (its pieces, or the joined tensors) and continues as
    the run that went on; the consolidated weights are the joined tensors."""
    from zeroshard.checkpoint import get_fp32_state_dict_from_zero_checkpoint

    saved_runs = [r["resume_tp"]["saved"] for r in four]
    saved = whole([{**run, "weights": run["at_save"]} for run in saved_runs])
    uninterrupted = whole(saved_runs)
    losses = saved_runs[0]["losses"]
    runs = [r["resume_tp"][layout] for layout in ("pp4", "pp1_dp4") for r in four]
    runs += run_distributed(_one_process, 1, checkpoint_dir, "pp2_tp2")
    assert any(run["splits"] for run in runs) and not all(run["splits"] for run in runs)
    for run in runs:
        assert run["global_steps"] == 3
        for name, value in run["at_save"].items():
            assert torch.equal(value, as_held(run, saved, name)), name
        assert max(abs(a - b) for a, b in zip(run["losses"], losses)) <= 1e-6, (run["losses"], losses)
        for name, value in run["weights"].items():
            torch.testing.assert_close(value, as_held(run, uninterrupted, name), rtol=1e-6, atol=1e-6, msg=name)
    consolidated = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag="pp2_tp2")
    assert set(consolidated) == set(saved)
    for name, value in consolidated.items():
        assert torch.equal(value, saved[name]), name
