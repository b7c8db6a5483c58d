"""Parity runs: N training steps with the engine vs one process on the full batch.

The rule being checked: N ranks x micro-batch b x accumulation g equals one process on a batch of
N*b*g samples, because ``backward`` scales by 1/g and gradients are averaged over ranks.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch

from .delays import inject_delays
from .harness import RANK_THREADS
from .models import GPT, GPTConfig

MODEL = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
SEQ = 8


@dataclass(frozen=True)
class ParityCase:
    stage: int
    dtype: str = "fp32"  # fp32 | bf16 | fp16
    gas: int = 1
    micro_batch: int = 2
    steps: int = 3
    clip: float = 0.0
    optimizer: str = "AdamW"
    lr: float = 1e-2
    optimizer_params: tuple = field(default=())  # (key, value) pairs beyond lr and weight_decay
    overlap_comm: bool = False
    bucket_size: int = 500_000_000
    shard_size: int = 0  # hybrid sharding group size; 0 = all ranks
    extra: tuple = field(default=())  # (key, value) pairs merged into the config
    zero: tuple = field(default=())  # (key, value) pairs merged into zero_optimization
    comm_delay_s: float = 0.0  # random delays injected around every collective (race testing)
    model: GPTConfig = MODEL
    frozen: tuple[str, ...] = ()  # parameter names with requires_grad=False
    zero_init: bool = False  # build the model under zeroshard.zero.Init (values from zero.reset_parameters)

    @property
    def params(self) -> dict[str, Any]:
        return dict(self.optimizer_params)

    def config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": self.micro_batch,
            "gradient_accumulation_steps": self.gas,
            "gradient_clipping": self.clip,
            "steps_per_print": 10_000,
            "optimizer": {"type": self.optimizer, "params": {"lr": self.lr, "weight_decay": 0.01, **self.params}},
            "zero_optimization": {
                "stage": self.stage,
                "overlap_comm": self.overlap_comm,
                "reduce_bucket_size": self.bucket_size,
            },
        }
        cfg["zero_optimization"].update(dict(self.zero))
        if self.shard_size:
            cfg["zero_optimization"]["zero_hpz_partition_size"] = self.shard_size
        if self.dtype == "bf16":
            cfg["bf16"] = {"enabled": True}
        if self.dtype == "fp16":
            cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
        cfg.update(dict(self.extra))
        return cfg


def make_model(seed: int = 0, model: GPTConfig = MODEL, frozen: tuple[str, ...] = ()) -> GPT:
    torch.manual_seed(seed)
    gpt = GPT(model)
    for name, param in gpt.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
    return gpt


def make_batches(steps: int, global_batch: int, seed: int = 1, vocab_size: int = MODEL.vocab_size):
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, vocab_size, (steps, global_batch, SEQ + 1), generator=gen)
    return [(d[:, :-1], d[:, 1:]) for d in data]


@contextlib.contextmanager
def rank_threads():
    """Run a reference with the ranks' thread count (``harness.RANK_THREADS``). CPU GEMMs block, and so round,
    differently per thread count: on an AVX-512 Xeon a 768-wide GPT-2's plain AdamW run moves by 2.2e-5 relative
    between 1 and 2 threads (Adam turns a last-bit difference in a near-zero gradient into a step of lr), which is
    twice the parity tolerance and 8x what exact 2-way data parallelism itself changes (2.9e-6)."""
    before = torch.get_num_threads()
    torch.set_num_threads(RANK_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def reference_train(case: ParityCase, world_size: int) -> dict[str, torch.Tensor]:
    """Plain single-process fp32 training on the full global batch, with the ranks' thread count."""
    with rank_threads():
        return _reference_train(case, world_size)


def _reference_train(case: ParityCase, world_size: int) -> dict[str, torch.Tensor]:
    model = make_model(model=case.model, frozen=case.frozen)
    if case.zero_init:
        from ..zero import reset_parameters

        reset_parameters(model, seed=0)
    from .. import optim  # one process: a 1-bit optimizer's compressed phase runs uncompressed

    opt_cls = {"AdamW": torch.optim.AdamW, "SGD": torch.optim.SGD}.get(case.optimizer) or getattr(optim, case.optimizer)
    opt = opt_cls([p for p in model.parameters() if p.requires_grad], lr=case.lr, weight_decay=0.01, **case.params)
    for x, y in make_batches(case.steps, world_size * case.micro_batch * case.gas, vocab_size=case.model.vocab_size):
        model(x, y).backward()
        if case.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def engine_train(case: ParityCase) -> dict[str, Any]:
    """Run inside every rank: train with the engine, return final fp32 weights and the engine's counters."""
    import zeroshard
    from zeroshard import comm

    with zeroshard.zero.Init(enabled=case.zero_init, seed=0):
        model = make_model(model=case.model, frozen=case.frozen)
    inject_delays(case.comm_delay_s)
    engine, _, _, _ = zeroshard.initialize(model=model, config=case.config())
    rank, world = comm.get_rank(), comm.get_world_size()
    b = case.micro_batch
    for x, y in make_batches(case.steps, world * b * case.gas, vocab_size=case.model.vocab_size):
        for k in range(case.gas):
            rows = slice((k * world + rank) * b, (k * world + rank + 1) * b)
            loss = engine(x[rows], y[rows])
            engine.backward(loss)
            engine.step()
    ledger = engine.comm_ledger  # this engine's training traffic (initialize's broadcast is not in it)
    traffic = {
        "wire_bytes": ledger.total_wire_bytes(),
        "ledger": {f"{op}/{group}": (t.calls, t.bytes) for (op, group), t in ledger.summary().items()},
    }
    return {
        **traffic,
        "params": {k: v.float() for k, v in engine.consolidated_state_dict(rank0_only=False).items()},
        "state_bytes": engine.state_bytes(),
        "state_bytes_by_location": engine.state_bytes_by_location(),
        "peak_gathered_numel": engine.stage3.peak_live_numel if engine.stage3 else None,
        "units": (
            [(u.name, u.numel) for u in [engine.stage3.root_unit, *engine.stage3.units]] if engine.stage3 else None
        ),
        "flat_numels": [(f.layout.padded_numel, f.resident) for f in engine.stack.flat_groups],
        "global_steps": engine.global_steps,
        "skipped_steps": engine.skipped_steps,
        "num_params": sum(p.numel() for p in model.parameters()),
    }


def engine_train_many(cases: list[ParityCase]) -> list[dict[str, Any]]:
    """Several cases in one spawn: process start-up dominates small runs."""
    return [engine_train(case) for case in cases]


def model_error(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """||actual - expected|| / ||expected|| over all tensors concatenated."""
    a = torch.cat([actual[k].float().flatten() for k in expected])
    b = torch.cat([expected[k].float().flatten() for k in expected])
    return ((a - b).norm() / b.norm()).item()


def relative_error(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """Worst per-tensor ||actual - expected|| / ||expected||."""
    worst = 0.0
    for name, ref in expected.items():
        ref = ref.float()
        diff = (actual[name].float() - ref).norm() / ref.norm().clamp_min(1e-12)
        worst = max(worst, diff.item())
    return worst


__all__ = [
    "MODEL",
    "ParityCase",
    "engine_train",
    "engine_train_many",
    "make_batches",
    "make_model",
    "model_error",
    "reference_train",
    "relative_error",
]
