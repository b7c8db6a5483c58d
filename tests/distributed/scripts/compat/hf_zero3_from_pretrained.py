"""HF's ZeRO-3 `from_pretrained` (weights written inside GatheredParameters(modifier_rank=0) on rank 0) must load
every weight exactly. Unmodified DeepSpeed usage: run with `zeroshard --as_deepspeed --num_gpus 2`.

usage: hf_zero3_from_pretrained.py PRETRAINED_DIR"""

import sys

import deepspeed
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from transformers.integrations import HfDeepSpeedConfig

CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}


def model_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def held_bytes(model) -> int:
    """What this rank holds of the parameters: real ones whole, the rest as the slice zero.Init keeps (a probe of
    zeroshard's records, outside DeepSpeed's API)."""
    from zeroshard.zero.materialize import pending_recipe

    held = 0
    for param in model.parameters():
        if not param.is_meta:
            held += param.numel() * param.element_size()
        elif (piece := getattr(pending_recipe(param).initial, "piece", None)) is not None:
            held += piece.numel() * piece.element_size()
    return held


def main(pretrained: str) -> None:
    deepspeed.init_distributed()
    keep_alive = HfDeepSpeedConfig(CONFIG)  # tells transformers that ZeRO-3 is on: build under zero.Init
    model = AutoModelForCausalLM.from_pretrained(pretrained, dtype=torch.float32)
    print(f"rank {deepspeed.comm.get_rank()} holds {held_bytes(model)} of {model_bytes(model)} bytes before initialize")
    engine, *_ = deepspeed.initialize(model=model, config=CONFIG)
    state = engine._zero3_consolidated_16bit_state_dict()
    if deepspeed.comm.get_rank() == 0:
        expected = load_file(f"{pretrained}/model.safetensors")
        wrong = [name for name, value in expected.items() if not torch.equal(state[name], value)]
        print(f"compared {len(expected)} tensors, differing: {wrong}")
        if wrong:
            raise SystemExit(1)
    del keep_alive


if __name__ == "__main__":
    main(sys.argv[1])
