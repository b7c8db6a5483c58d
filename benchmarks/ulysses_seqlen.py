"""The longest sequence that trains in a fixed memory budget on 2 ranks: Ulysses sequence parallelism (SP=2) against
data parallelism (SP=1, each rank its own whole sequence), with and without the tiled MLP and the tiled LM-head loss.

    python benchmarks/ulysses_seqlen.py [--budget_mib 256] [--max_tokens 32768] [--time_tokens 2048]

A Hugging Face Llama (hidden 128, MLP 512, 2 layers, 4 query / 2 key-value heads, a 16384-token vocabulary, sdpa),
ZeRO stage 2, AdamW. Each system runs in its own 2 fresh ranks: one warm-up step at 256 tokens (so the optimizer
state exists), then steps at growing lengths (x1.5 then x4/3, alternately: 512, 768, 1024, 1536, ...). The figure per
step is the peak resident memory of a rank during the step above its resident memory before it (Linux VmHWM, reset
through /proc/self/clear_refs before each step), the larger of the 2 ranks: activations, gradients and the
transient buffers of the step, the model states being already resident. The longest length whose peak stays within
the budget is reported; the search stops at the first one above it. Step time per token: the median of 3 steps at
``--time_tokens`` per sample divided by the tokens a rank computes in the step (the whole sample under SP=1, half
of it under SP=2).

On a GPU the same script would read ``max_memory_allocated``; this CPU run measures what a CPU run can.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from zeroshard.testing import run_distributed

VOCAB, HIDDEN, LAYERS = 16384, 128, 2
SYSTEMS = {  # name: (sequence_parallel_size, tiled MLP and loss)
    "SP=1": (1, False),
    "SP=1 + tiled": (1, True),
    "SP=2": (2, False),
    "SP=2 + tiled": (2, True),
}
TILE_TOKENS = 1024  # tokens per tile of the tiled MLP and loss


def _lengths(max_tokens: int) -> list[int]:
    lengths, length, grow = [], 512, True
    while length <= max_tokens:
        lengths.append(length)
        length = length * 3 // 2 if grow else length * 4 // 3
        grow = not grow
    return lengths


class TiledMLPModule(torch.nn.Module):
    def __init__(self, mlp: torch.nn.Module, group):
        super().__init__()
        self.mlp, self.group = mlp, group

    def forward(self, x):
        from zeroshard.sequence_parallel import agreed_tile_count, tiled_mlp

        return tiled_mlp(self.mlp, x, agreed_tile_count(x.shape[1], TILE_TOKENS, self.group))


class CausalLMLoss(torch.nn.Module):
    """The model and its loss over this rank's tokens: the LM head and cross-entropy per tile when ``tiled``."""

    def __init__(self, model: torch.nn.Module, tiled: bool, group):
        super().__init__()
        self.model, self.tiled, self.group = model, tiled, group
        if tiled:
            for layer in model.model.layers:
                layer.mlp = TiledMLPModule(layer.mlp, group)

    def forward(self, input_ids, position_ids, shift_labels):
        from zeroshard.sequence_parallel import TiledFusedLogitsLoss, agreed_tile_count

        if not self.tiled:
            return self.model(
                input_ids=input_ids, position_ids=position_ids, shift_labels=shift_labels, labels=shift_labels
            ).loss
        hidden = self.model.model(input_ids=input_ids, position_ids=position_ids).last_hidden_state
        tiles = agreed_tile_count(hidden.shape[1] * hidden.shape[0], TILE_TOKENS, self.group)

        def loss_sum(head, x, y):
            return torch.nn.functional.cross_entropy(head(x).float(), y, ignore_index=-100, reduction="sum")

        total = TiledFusedLogitsLoss.apply(loss_sum, self.model.lm_head, hidden, shift_labels, None, tiles, None, "sum")
        return total / (shift_labels != -100).sum().clamp(min=1)


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=4 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1 << 17,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def _resident_kib() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in KiB."""
    fields = {}
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":")
                fields[key] = int(value.split()[0])
    return fields["VmRSS"], fields["VmHWM"]


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # resets VmHWM to the current RSS


def worker(name: str, budget_mib: int, max_tokens: int, time_tokens: int) -> dict:
    import zeroshard
    from zeroshard.sequence_parallel import register_with_transformers, shift_labels, token_weighted_loss

    sp, tiled = SYSTEMS[name]
    model = _model()
    mpu = register_with_transformers(model, "sdpa", sp, micro_batch_size=1) if sp > 1 else None
    group = mpu.sequence if mpu is not None else zeroshard.comm.tensor_parallel_group(1)  # a group of this rank
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 2},
    }
    engine, *_ = zeroshard.initialize(model=CausalLMLoss(model, tiled, group), config=config, mpu=mpu)
    rank, g = zeroshard.comm.get_rank(), torch.Generator().manual_seed(zeroshard.comm.get_rank())

    def step(tokens: int) -> float:
        ids = torch.randint(0, VOCAB, (1, tokens), generator=g)
        labels = shift_labels(ids)
        piece = slice(group.rank * tokens // sp, (group.rank + 1) * tokens // sp)
        local = {
            "input_ids": ids[:, piece],
            "position_ids": torch.arange(tokens)[None, piece],
            "shift_labels": labels[:, piece],
        }
        started = time.perf_counter()
        loss = engine(**local)
        if sp > 1:
            loss = token_weighted_loss(loss, local["shift_labels"], group)
        engine.backward(loss)
        engine.step()
        return time.perf_counter() - started

    step(256)
    fits, peaks = 0, {}
    world = zeroshard.comm.group_of(None, "world")
    for tokens in _lengths(max_tokens):
        before, _ = _resident_kib()
        _reset_peak()
        step(tokens)
        peak = torch.tensor([_resident_kib()[1] - before], dtype=torch.int64)
        zeroshard.comm.all_reduce(peak, world, op="max")
        peaks[tokens] = int(peak) / 1024
        if peaks[tokens] > budget_mib:
            break
        fits = tokens
    times = [step(time_tokens) for _ in range(3)]
    per_token = statistics.median(times) / (time_tokens // sp)
    return {"rank": rank, "fits": fits, "peaks_mib": peaks, "s_per_token": per_token}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget_mib", type=int, default=256)
    parser.add_argument("--max_tokens", type=int, default=32768)
    parser.add_argument("--time_tokens", type=int, default=2048)
    args = parser.parse_args()
    rows = []
    for name in SYSTEMS:
        out = run_distributed(
            worker, 2, name, args.budget_mib, args.max_tokens, args.time_tokens, timeout_s=3600, comm_timeout_s=900
        )[0]
        rows.append((name, out))
        print(name, out, flush=True)
    base = rows[0][1]["fits"]
    print(f"\nbudget {args.budget_mib} MiB of step memory per rank, 2 ranks; step time at {args.time_tokens} tokens")
    print(f"{'system':<16}{'longest':>10}{'x SP=1':>8}{'peak MiB at longest':>22}{'us / token':>12}")
    for name, out in rows:
        peak = out["peaks_mib"].get(out["fits"], float("nan"))
        per_token = out["s_per_token"] * 1e6
        print(f"{name:<16}{out['fits']:>10}{out['fits'] / base:>8.2f}{peak:>22.0f}{per_token:>12.0f}")


if __name__ == "__main__":
    main()
