"""A Hugging Face Trainer script with Ulysses sequence parallelism from Accelerate's parallelism config (the
environment ``accelerate launch`` sets from ``parallelism_config_sp_backend: deepspeed`` and
``parallelism_config_sp_size: 2``); it imports only transformers and torch. Run unmodified with
`zeroshard --as_deepspeed hf_ulysses.py PRETRAINED_DIR OUT_DIR` and that environment.

The Trainer's Accelerate path registers DeepSpeed's ``UlyssesSPAttentionHF``, passes its mpu to
``deepspeed.initialize``, wraps the loader in ``UlyssesSPDataLoaderAdapter`` and computes the token-weighted loss
over the sequence-parallel group. SFT-style samples: the first 20 of 32 labels are -100, so one rank's piece of
every sample holds no counted token. Trains 3 steps at ZeRO-3 and prints what the test checks. With
``--reference`` (one plain process, no DeepSpeed, no sequence parallelism): the same Trainer on whole sequences, the
losses the sequence-parallel run must reproduce."""

import json
import sys

import torch
from transformers import LlamaForCausalLM, Trainer, TrainingArguments

STEPS, LENGTH, PROMPT = 3, 32, 20


class Prompted(torch.utils.data.Dataset):
    def __init__(self, n: int = 12, vocab: int = 128):
        self.ids = torch.randint(0, vocab, (n, LENGTH), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        labels = self.ids[i].clone()
        labels[:PROMPT] = -100
        return {"input_ids": self.ids[i], "labels": labels, "position_ids": torch.arange(LENGTH)}


CONFIG = {
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
    "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
}


def main(pretrained: str, out_dir: str, reference: bool = False) -> None:
    args = TrainingArguments(
        output_dir=out_dir,
        deepspeed=None if reference else CONFIG,
        use_cpu=reference,
        per_device_train_batch_size=1,
        max_steps=STEPS,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
    )
    model = LlamaForCausalLM.from_pretrained(pretrained, torch_dtype=torch.float32, attn_implementation="sdpa")
    trainer = Trainer(model=model, args=args, train_dataset=Prompted())
    trainer.train()
    engine = trainer.model_wrapped
    if trainer.is_world_process_zero():
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        result = {"global_step": trainer.state.global_step, "losses": losses}
        if not reference:
            result.update(
                sequence_parallel_size=engine.sequence_parallel_size,
                train_batch_size=engine.train_batch_size(),
                engine=type(engine).__module__,
            )
        print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], reference="--reference" in sys.argv[3:])
