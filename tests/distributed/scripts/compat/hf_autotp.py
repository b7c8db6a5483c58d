"""A Hugging Face Trainer script with LLaMA-Factory's AutoTP config (``examples/deepspeed/ds_z2_autotp_config.json``:
ZeRO-2, ``tensor_parallel.autotp_size: 2``, "auto" batch sizes); it imports only transformers and torch.
Run unmodified with `zeroshard --as_deepspeed --num_gpus 4 hf_autotp.py PRETRAINED_DIR OUT_DIR`.

Fine-tunes a tiny Llama for 3 steps on 2 tensor-parallel x 2 data-parallel ranks, saves the model, and prints what
the test checks. One key is added to LLaMA-Factory's file: ``stage3_gather_16bit_weights_on_model_save``, without
which ``save_model`` writes a training checkpoint instead of weights (under DeepSpeed as under zeroshard: Accelerate
asks the engine whether to gather)."""

import json
import sys

import torch
from hf_trainer import Tokens  # the script beside this one
from transformers import LlamaForCausalLM, Trainer, TrainingArguments

STEPS = 3

LLAMA_FACTORY_AUTOTP = {  # the file's shape, its comment key included
    "_comment": "suooprted model list: https://www.deepspeed.ai/tutorials/automatic-tensor-parallelism/#supported-models",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_allow_untested_optimizer": True,
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "bf16": {"enabled": "auto"},
    "zero_optimization": {
        "stage": 2,
        "allgather_partitions": True,
        "allgather_bucket_size": 5e8,
        "overlap_comm": False,
        "reduce_scatter": True,
        "reduce_bucket_size": 5e8,
        "contiguous_gradients": True,
        "round_robin_gradients": True,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "tensor_parallel": {"autotp_size": 2},
}


def main(pretrained: str, out_dir: str) -> None:
    args = TrainingArguments(
        output_dir=out_dir,
        deepspeed=LLAMA_FACTORY_AUTOTP,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        max_steps=STEPS,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
    )
    model = LlamaForCausalLM.from_pretrained(pretrained, torch_dtype=torch.float32)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(n=48, vocab=128))
    trainer.train()
    trainer.save_model(f"{out_dir}/final")
    engine = trainer.model_wrapped
    gathered = engine.consolidated_state_dict(rank0_only=True)
    if trainer.is_world_process_zero():
        torch.save(gathered, f"{out_dir}/gathered.pt")
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        result = {
            "global_step": trainer.state.global_step,
            "losses": losses,
            "autotp_size": engine.autotp_size(),
            "train_batch_size": engine.train_batch_size(),
        }
        print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
