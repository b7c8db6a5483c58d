"""Tensor-parallel inference of a ~124M GPT-2 config at TP = 1, 2, 4: tokens/s and memory per rank.

    python benchmarks/tp_inference.py [--tp 1 2 4] [--dtype fp32] [--new_tokens 32]

The random-initialized model is saved once as a Hugging Face checkpoint; every TP size then builds it
on the meta device and loads only its own slices, as a served model would. Per TP size: parameter
bytes per rank (against the analytic 1/N of the sharded weights plus the replicated ones), peak RSS
per rank and its growth over an idle process, prefill latency for one prompt, and generation tokens/s
(greedy, KV cache, batch 1). Each rank gets cores / TP threads so every TP size uses the whole machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import transformers

from zeroshard.accelerator import host_peak_rss
from zeroshard.testing import run_distributed


def gpt2_config() -> transformers.GPT2Config:
    config = transformers.GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)
    config._attn_implementation = "sdpa"
    return config


def worker(directory: str, dtype: str, tp: int, prompt_len: int, new_tokens: int, repeats: int) -> dict:
    import zeroshard

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))
    idle = host_peak_rss()
    with zeroshard.init_empty_weights():
        model = transformers.GPT2LMHeadModel(gpt2_config())
    started = time.perf_counter()
    engine = zeroshard.init_inference(model, tensor_parallel={"tp_size": tp}, dtype=dtype, checkpoint=directory)
    load = time.perf_counter() - started
    prompt = torch.randint(0, 50257, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    engine(prompt)  # warm-up
    prefill, generate = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        engine(prompt)
        prefill.append(time.perf_counter() - started)
        started = time.perf_counter()
        ids = engine.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        generate.append(time.perf_counter() - started)
    return {
        "param_bytes": engine.parameter_bytes(),
        "peak_device": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None,
        "peak_rss": host_peak_rss(),
        "idle_rss": idle,
        "load_s": load,
        "prefill_s": statistics.median(prefill),
        "generate_s": statistics.median(generate),
        "ids": ids[0, prompt_len:].tolist(),
    }


def analytic_bytes(model: torch.nn.Module, tp: int, element: int) -> int:
    """1/tp of every block weight (row-parallel biases whole) and of the padded vocabulary; the rest whole."""
    per_vocab = -(-model.config.vocab_size // tp)
    total = 0
    for name, p in model.named_parameters():  # tied LM head counted once, with the embedding
        if name == "transformer.wte.weight":
            total += per_vocab * p.shape[1]
        elif ".h." in name and name.endswith((".c_attn.weight", ".c_fc.weight", ".c_proj.weight")):
            total += p.numel() // tp
        elif ".h." in name and name.endswith((".c_attn.bias", ".c_fc.bias")):
            total += p.numel() // tp
        else:
            total += p.numel()
    return total * element


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--prompt_len", type=int, default=128)
    parser.add_argument("--new_tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(gpt2_config())
    params = sum(p.numel() for p in model.parameters())
    element = 4 if args.dtype == "fp32" else 2
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        for tp in args.tp:
            results = run_distributed(
                worker,
                tp,
                directory,
                args.dtype,
                tp,
                args.prompt_len,
                args.new_tokens,
                args.repeats,
                timeout_s=3600,
                env={"ZEROSHARD_ACCELERATOR": "cuda" if torch.cuda.is_available() else "cpu"},
                fresh_interpreters=True,  # its peak RSS is a whole process's, as launched
            )
            rows.append((tp, results, analytic_bytes(model, tp, element)))
    print(
        f"GPT-2 config, {params / 1e6:.1f}M parameters, {args.dtype}, {os.cpu_count()} cores, prompt "
        f"{args.prompt_len} tokens, {args.new_tokens} new tokens (greedy, KV cache, batch 1)\n"
    )
    print(
        "| TP | parameter MiB/rank | analytic | peak RSS/rank MiB | RSS over idle MiB | load s | prefill ms | "
        "generate tokens/s | same tokens as TP=1 |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    reference = rows[0][1][0]["ids"]
    for tp, results, analytic in rows:
        r = results[0]
        same = all(x["ids"] == reference for x in results)
        print(
            f"| {tp} | {r['param_bytes'] / 2**20:.1f} | {analytic / 2**20:.1f} | "
            f"{max(x['peak_rss'] for x in results) / 2**20:.0f} | "
            f"{max(x['peak_rss'] - x['idle_rss'] for x in results) / 2**20:.0f} | {r['load_s']:.1f} | "
            f"{r['prefill_s'] * 1e3:.0f} | {args.new_tokens / r['generate_s']:.1f} | {same} |"
        )
        if r["peak_device"] is not None:
            print(f"  TP={tp}: peak device memory {r['peak_device'] / 2**20:.0f} MiB on rank 0")


if __name__ == "__main__":
    main()
