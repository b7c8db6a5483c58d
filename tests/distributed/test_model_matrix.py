"""Real model classes x sharding paths, each against the single-process reference (one spawn for all).

- Stage 3 gather units over HF GPT-2, Llama and BERT, a CNN, a model holding its blocks in a
  ``ModuleDict``, a block called twice and weights shared across blocks, with the unit-size threshold
  inside a block, between a block and the whole model, and above the whole model; plus the default
  config (the model's repeated blocks become the units) on a 768-wide GPT-2.
- Activation checkpointing of a block called twice, reentrant and not, under stages 0-3: a gradient
  hook that fires once per recomputation must not start a reduction before the last contribution.

fp32, AdamW: the whole-model relative error must stay <= 1e-5.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from zeroshard.testing import run_distributed
from zeroshard.testing.parity import model_error, rank_threads

WORLD = 2
MICRO_BATCH = 2
STEPS = 2
SEQ = 8
VOCAB = 64


# -- the models -------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 2 * width)
        self.out = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.out(F.gelu(self.fc(self.norm(x))))


class BlocksInModuleDict(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleDict({"first": Block(width), "second": Block(width), "third": Block(width)})
        self.head = nn.Linear(width, VOCAB)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks.values():
            h = block(h)
        return self.head(h)


class BlockCalledTwice(nn.Module):
    """The middle block runs twice per forward; with ``checkpointing`` each call is recomputed in backward."""

    def __init__(self, width: int = 16, checkpointing: str = "none"):
        super().__init__()
        self.checkpointing = checkpointing
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(3))
        self.head = nn.Linear(width, VOCAB)

    def run(self, block, h):
        if self.checkpointing == "none":
            return block(h)
        return checkpoint(block, h, use_reentrant=self.checkpointing == "reentrant")

    def forward(self, x):
        h = self.embed(x)
        for block in (self.blocks[0], self.blocks[1], self.blocks[1], self.blocks[2]):
            h = self.run(block, h)
        return self.head(h)


class SharedAcrossBlocks(nn.Module):
    """Blocks of their own, whose first Linear is one shared weight (tied across would-be units)."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(3))
        for block in self.blocks[1:]:
            block.fc.weight = self.blocks[0].fc.weight
        self.head = nn.Linear(width, VOCAB)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(),
            nn.Conv2d(8, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.ReLU(),
            nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
        )  # fmt: skip
        self.classifier = nn.Linear(16, 10)

    def forward(self, x):
        return self.classifier(self.features(x).mean(dim=(2, 3)))


def hf_gpt2(n_embd: int = 32, n_layer: int = 3):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=n_embd, n_layer=n_layer, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return GPT2LMHeadModel(cfg)


def hf_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


def hf_bert():
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
        max_position_embeddings=SEQ, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return BertForMaskedLM(cfg)


def hf_loss(model, x, y):
    return model(input_ids=x, labels=y).loss


def lm_loss(model, x, y):
    return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


def image_loss(model, x, y):
    return F.cross_entropy(model(x), y)


# model name -> (builder, loss, repeated block class, input kind)
MODELS = {
    "gpt2": (hf_gpt2, hf_loss, "GPT2Block", "tokens"),
    "llama": (hf_llama, hf_loss, "LlamaDecoderLayer", "tokens"),
    "bert": (hf_bert, hf_loss, "BertLayer", "tokens"),
    "cnn": (SmallCNN, image_loss, "Conv2d", "images"),
    "moduledict": (BlocksInModuleDict, lm_loss, "Block", "tokens"),
    "called-twice": (BlockCalledTwice, lm_loss, "Block", "tokens"),
    "shared-weights": (SharedAcrossBlocks, lm_loss, "Block", "tokens"),
    "gpt2-768": (lambda: hf_gpt2(n_embd=768, n_layer=2), hf_loss, "GPT2Block", "tokens"),
    "ckpt-reentrant": (lambda: BlockCalledTwice(checkpointing="reentrant"), lm_loss, "Block", "tokens"),
    "ckpt-nonreentrant": (lambda: BlockCalledTwice(checkpointing="non-reentrant"), lm_loss, "Block", "tokens"),
}


@dataclass(frozen=True)
class Case:
    model: str
    stage: int = 3
    threshold: str = "default"  # inside-block | between | above-model | default (no key) | classes

    def zero_config(self, model: nn.Module) -> dict:
        zero = {"stage": self.stage, "stage3_param_persistence_threshold": 0}
        if self.threshold == "default":
            return {"stage": self.stage}
        block_class = MODELS[self.model][2]
        block = next(m for m in model.modules() if type(m).__name__ == block_class)
        block_numel = sum(p.numel() for p in block.parameters())
        total = sum(p.numel() for p in model.parameters())
        if self.threshold == "classes":
            zero["gather_unit_classes"] = [block_class]
        else:
            zero["gather_unit_min_params"] = {
                "inside-block": max(block_numel // 3, 1),
                "between": block_numel + 1,  # more than a block, less than the whole model
                "above-model": total + 1,
            }[self.threshold]
        return zero


THRESHOLDS = ("inside-block", "between", "above-model")
CASES = [Case(m, threshold=t) for m in ("gpt2", "llama", "bert", "cnn", "moduledict", "called-twice",
                                        "shared-weights") for t in THRESHOLDS]  # fmt: skip
CASES += [Case("gpt2", threshold="default"), Case("gpt2-768", threshold="default")]
CASES += [Case(m, stage=s, threshold="classes" if s == 3 else "default")
          for m in ("ckpt-reentrant", "ckpt-nonreentrant") for s in range(4)]  # fmt: skip


def build(case: Case) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[case.model][0]()


def batches(case: Case) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    n = WORLD * MICRO_BATCH
    if MODELS[case.model][3] == "images":
        return [
            (torch.randn(n, 3, 8, 8, generator=gen), torch.randint(0, 10, (n,), generator=gen)) for _ in range(STEPS)
        ]
    data = [torch.randint(0, VOCAB, (n, SEQ + 1), generator=gen) for _ in range(STEPS)]
    return [(d[:, :-1].contiguous(), (d[:, :-1] if case.model == "bert" else d[:, 1:]).contiguous()) for d in data]


def reference(case: Case) -> dict[str, torch.Tensor]:
    with rank_threads():  # the ranks' thread count: GEMM rounding depends on it
        return _reference(case)


def _reference(case: Case) -> dict[str, torch.Tensor]:
    model = build(case)
    loss_fn = MODELS[case.model][1]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    for x, y in batches(case):
        loss_fn(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_all(cases: list[Case]) -> list[dict]:
    import zeroshard
    from zeroshard import comm

    rank = comm.get_rank()
    results = []
    for case in cases:
        model = build(case)
        config = {
            "train_micro_batch_size_per_gpu": MICRO_BATCH,
            "gradient_clipping": 0.0,  # the reference does not clip (DeepSpeed's default would clip at 1.0)
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
            "zero_optimization": case.zero_config(model),
        }
        engine, _, _, _ = zeroshard.initialize(model=model, config=config)
        loss_fn = MODELS[case.model][1]
        for x, y in batches(case):
            rows = slice(rank * MICRO_BATCH, (rank + 1) * MICRO_BATCH)
            engine.backward(loss_fn(engine, x[rows], y[rows]))
            engine.step()
        units = [u.name for u in engine.stage3.units] if engine.stage3 else []
        results.append({"params": engine.consolidated_state_dict(rank0_only=False), "units": units})
        engine.destroy()
    return results


@pytest.fixture(scope="module")
def trained():
    return run_distributed(train_all, WORLD, CASES, timeout_s=600)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"{c.model}-stage{c.stage}-{c.threshold}" for c in CASES])
def test_matches_single_process_reference(trained, index):
    case = CASES[index]
    got = trained[0][index]
    assert model_error(got["params"], reference(case)) <= 1e-5
    for other in trained[1:]:
        for name, tensor in got["params"].items():
            torch.testing.assert_close(other[index]["params"][name], tensor, rtol=0, atol=0)


def test_units_are_modules_that_run(trained):
    """No container among the units, and the thresholds really produce units inside blocks, per block and none."""
    by_case = dict(zip(CASES, trained[0]))
    assert by_case[Case("gpt2-768")]["units"]  # the default finds the repeated blocks
    for case, got in by_case.items():
        assert not any(name.endswith(("h", "layers", "layer", "blocks")) for name in got["units"]), (case, got)
        if case.threshold == "above-model":
            assert got["units"] == [], case
    # with no unit configuration, the units are the model's repeated blocks (GPT2Block), not its ModuleList
    assert by_case[Case("gpt2-768")]["units"][:2] == ["transformer.h.0", "transformer.h.1"]
    assert "transformer.h.0.mlp" in by_case[Case("gpt2", threshold="inside-block")]["units"]
