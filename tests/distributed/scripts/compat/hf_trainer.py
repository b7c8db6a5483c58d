"""A Hugging Face Trainer script with a DeepSpeed "auto" config; it imports only transformers and torch.
Run unmodified with `zeroshard --as_deepspeed --num_gpus 2 hf_trainer.py OUT_DIR STAGE [--resume] [--nvme]
[--deepcompile]` (``--nvme``: DeepSpeed's documented ZeRO-Infinity config, stage 3; ``--deepcompile``: axolotl's
``deepcompile: true`` with ``torch_compile: true``, the compile block its check_deepcompile adds to the config and
the Trainer's torch_compile, which Accelerate turns into ``engine.compile()``).

Trains a tiny GPT-2 for 4 steps (saving at step 2), saves the model, and prints what the test checks."""

import json
import os
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

STEPS = 4


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, length: int = 16, vocab: int = 96):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def infinity(nvme_path: str) -> dict:
    """DeepSpeed's documented ZeRO-Infinity blocks (its zero.md tutorial and the HF DeepSpeed guide), verbatim
    but for the path."""
    return {
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {
                "device": "nvme",
                "nvme_path": nvme_path,
                "pin_memory": True,
                "buffer_count": 4,
                "fast_init": False,
            },
            "offload_param": {
                "device": "nvme",
                "nvme_path": nvme_path,
                "pin_memory": True,
                "buffer_count": 5,
                "buffer_size": 1e8,
                "max_in_cpu": 1e9,
            },
            "overlap_comm": True,
            "contiguous_gradients": True,
            "sub_group_size": 1e9,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
            "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "aio": {
            "block_size": 262144,
            "queue_depth": 32,
            "thread_count": 1,
            "single_submit": False,
            "overlap_events": True,
        },
    }


def config(stage: int, nvme_path: str = "", deepcompile: bool = False) -> dict:
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
        },
        "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True},
        **(infinity(nvme_path) if nvme_path else {}),
        **({"compile": {"deepcompile": True}} if deepcompile else {}),
    }


def main(out_dir: str, stage: int, resume: bool, nvme: bool, deepcompile: bool) -> None:
    if nvme:  # ZeRO-Infinity: parameters and optimizer state in swap files under OUT_DIR/nvme
        os.makedirs(f"{out_dir}/nvme", exist_ok=True)
    args = TrainingArguments(
        output_dir=out_dir,
        deepspeed=config(stage, f"{out_dir}/nvme" if nvme else "", deepcompile),
        torch_compile=deepcompile,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=STEPS,
        save_steps=2,
        learning_rate=1e-3,
        warmup_steps=1,
        logging_steps=1,
        report_to=[],
        seed=0,
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=16))
    trainer = Trainer(model=model, args=args, train_dataset=Tokens())
    result = trainer.train(resume_from_checkpoint=f"{out_dir}/checkpoint-2" if resume else None)
    final = f"{out_dir}/final-resumed" if resume else f"{out_dir}/final"
    trainer.save_model(final)
    state = trainer.accelerator.get_state_dict(trainer.model_wrapped)  # gathered weights on rank 0
    if trainer.is_world_process_zero():
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        torch.save(state, f"{final}/gathered.pt")
        print(
            "RESULT "
            + json.dumps(
                {"global_step": trainer.state.global_step, "losses": losses, "train_loss": result.training_loss}
            )
        )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), "--resume" in sys.argv, "--nvme" in sys.argv, "--deepcompile" in sys.argv)
