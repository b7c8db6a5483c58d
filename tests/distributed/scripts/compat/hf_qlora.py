"""QLoRA as Hugging Face documents it with DeepSpeed: a 4-bit base (bitsandbytes, ``bnb_4bit_quant_storage`` =
bf16) with peft LoRA adapters, trained by the HF Trainer. It imports only transformers, peft, bitsandbytes and
torch. Run unmodified with `zeroshard --as_deepspeed --num_gpus 2 hf_qlora.py OUT_DIR PRETRAINED STAGE`, or as
`python hf_qlora.py OUT_DIR PRETRAINED reference` (one process, no DeepSpeed: the reference losses).

Trains 4 steps of 4 sequences (2 per rank), saves the adapters, reloads them with peft on rank 0 and prints what
the test checks."""

import json
import sys

import torch
from hf_trainer import Tokens  # the script beside this one
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, Trainer, TrainingArguments

STEPS = 4


def quantized_base(pretrained: str):
    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_quant_storage=torch.bfloat16,  # what HF's QLoRA + ZeRO-3 recipe sets: shardable like bf16
    )
    return AutoModelForCausalLM.from_pretrained(pretrained, quantization_config=quantization, dtype=torch.bfloat16)


def config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": 0,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
    }


def packed_bytes(engine) -> tuple[int, int]:
    """(this rank's bytes of 4-bit storage, the model's): what ZeRO-3 shards of the frozen base."""
    packed = [p for p in engine.module.parameters() if getattr(p, "quant_state", None) is not None]
    total = sum(p.numel() * p.element_size() for p in packed)  # full shapes, also while sharded
    ids = {id(p) for p in packed}
    mine = sum(
        flat.shard.numel() * flat.shard.element_size()
        for flat in engine.stack.frozen_groups
        if id(flat.params[0]) in ids
    )
    return mine, total


def main(out_dir: str, pretrained: str, mode: str) -> None:
    reference = mode == "reference"
    args = TrainingArguments(
        output_dir=out_dir,
        deepspeed=None if reference else config(int(mode)),
        per_device_train_batch_size=4 if reference else 2,
        max_steps=STEPS,
        learning_rate=1e-2,
        weight_decay=0.0,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        bf16=True,
        report_to=[],
        seed=0,
        use_cpu=True,  # bf16 on CPU ranks: the Trainer asks for it (zeroshard runs DeepSpeed on CPU ranks)
    )
    torch.manual_seed(0)
    model = get_peft_model(
        quantized_base(pretrained), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    )
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(n=32, length=12, vocab=128))
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    if reference:
        print("RESULT " + json.dumps({"losses": losses}))
        return
    mine, total = packed_bytes(trainer.model_wrapped)
    print(f"PACKED rank {trainer.args.process_index} {mine} {total}", flush=True)
    trainer.save_model(f"{out_dir}/adapter")
    state = trainer.accelerator.get_state_dict(trainer.model_wrapped)  # gathered on rank 0
    if trainer.is_world_process_zero():
        reloaded = PeftModel.from_pretrained(quantized_base(pretrained), f"{out_dir}/adapter")
        adapters = {n: p for n, p in reloaded.named_parameters() if "lora_" in n}
        differing = [n for n, p in adapters.items() if not torch.equal(p.detach().to(state[n].dtype), state[n])]
        print(
            "RESULT "
            + json.dumps({"losses": losses, "adapters": len(adapters), "differing": differing, "stage": int(mode)})
        )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
