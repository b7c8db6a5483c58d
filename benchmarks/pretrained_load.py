"""Peak memory per rank for loading a pretrained GPT-2 into a ZeRO-3 model, two ways, same run:

- ``hf``: Hugging Face's ZeRO-3 path (``from_pretrained`` under ``zero.Init``, each module's weights written on
  rank 0 inside ``GatheredParameters(modifier_rank=0)`` and broadcast), then ``initialize``;
- ``zeroshard``: ``zero.Init`` then ``zeroshard.initialize(pretrained=dir)``: every rank reads one flat group at
  a time from the safetensors file and keeps its shard.

    python benchmarks/pretrained_load.py [--world 2] [--n_layer 12] [--n_embd 768] [--vocab 32000]

Reports each rank's peak resident set (VmHWM) above the interpreter's after imports, the model-state bytes the
rank keeps (its shards), and the difference: what loading cost on top.
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch

from zeroshard.accelerator import host_peak_rss
from zeroshard.testing import run_distributed

CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "steps_per_print": 10**9,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    "zero_optimization": {"stage": 3},
}


def worker(path: str, way: str) -> dict:
    import transformers  # noqa: F401  (imports before the baseline)

    import zeroshard

    zeroshard.install_as_deepspeed()
    import deepspeed
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel
    from transformers.integrations import HfDeepSpeedConfig

    baseline = host_peak_rss()
    if way == "hf":
        keep = HfDeepSpeedConfig(CONFIG)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        engine, *_ = deepspeed.initialize(model=model, config=CONFIG)
        del keep
    else:
        with zeroshard.zero.Init():
            model = GPT2LMHeadModel(GPT2Config.from_pretrained(path))
        engine, *_ = zeroshard.initialize(model=model, config=CONFIG, pretrained=path)
    params = sum(p.numel() for p in model.parameters())
    state = sum(engine.state_bytes().values())  # what the rank keeps: its shards of parameters and gradients
    return {"peak_above_baseline": host_peak_rss() - baseline, "param_bytes": params * 4, "state_bytes": state}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--n_layer", type=int, default=12)
    parser.add_argument("--n_embd", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()
    from transformers import GPT2Config, GPT2LMHeadModel

    with tempfile.TemporaryDirectory() as path:
        config = GPT2Config(
            n_layer=args.n_layer,
            n_embd=args.n_embd,
            n_head=12,
            vocab_size=args.vocab,
            n_positions=256,
            bos_token_id=0,
            eos_token_id=0,
        )
        GPT2LMHeadModel(config).save_pretrained(path)
        results = {}
        for way in ("hf", "zeroshard"):
            ranks = run_distributed(worker, args.world, path, way, timeout_s=900)
            results[way] = {
                "peak_MiB_per_rank": [round(r["peak_above_baseline"] / 2**20) for r in ranks],
                "param_MiB": round(ranks[0]["param_bytes"] / 2**20),
                "kept_state_MiB_per_rank": [round(r["state_bytes"] / 2**20) for r in ranks],
                "loading_overhead_MiB_per_rank": [
                    round((r["peak_above_baseline"] - r["state_bytes"]) / 2**20) for r in ranks
                ],
            }
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
