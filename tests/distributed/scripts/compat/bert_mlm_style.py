"""A DeepSpeed tutorial-style masked-LM trainer (after DeepSpeedExamples' HelloDeepSpeed/train_bert_ds.py),
written against `deepspeed.*` only: save_checkpoint with a client_state (including a tensor), load_checkpoint
to resume. Run unmodified: `zeroshard --as_deepspeed --num_gpus 2 bert_mlm_style.py --checkpoint_dir D
--deepspeed_config ds.json [--steps 6] [--save_at 3] [--resume]`."""

import argparse
import json

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from transformers import BertConfig, BertForMaskedLM

VOCAB, LENGTH, MASK_ID = 64, 12, 3


def batch(step: int, rank: int, size: int):
    """Deterministic per (step, rank): a resumed run sees exactly the batches the uninterrupted one saw."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(5, VOCAB, (size, LENGTH), generator=g)
    masked = torch.rand(size, LENGTH, generator=g) < 0.15
    masked[:, 0] = True
    labels = torch.where(masked, ids, torch.full_like(ids, -100))
    return ids.masked_fill(masked, MASK_ID), labels


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--checkpoint_dir", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save_at", type=int, default=3)
    parser.add_argument("--resume", action="store_true")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    deepspeed.init_distributed()
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=LENGTH,
    )
    model = BertForMaskedLM(config)
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    device = get_accelerator().current_device_name()
    start, client = 0, None
    if args.resume:
        path, client = engine.load_checkpoint(args.checkpoint_dir)
        start = client["step"]
    losses = []
    for step in range(start, args.steps):
        ids, labels = batch(step, deepspeed.comm.get_rank(), engine.train_micro_batch_size_per_gpu())
        loss = engine(input_ids=ids.to(device), labels=labels.to(device)).loss
        engine.backward(loss)
        engine.step()
        losses.append(round(loss.item(), 6))
        if step + 1 == args.save_at and not args.resume:
            engine.save_checkpoint(
                args.checkpoint_dir,
                client_state={"step": step + 1, "best_loss": torch.tensor(min(losses)), "note": "hello"},
            )
    if deepspeed.comm.get_rank() == 0:
        restored = None
        if client is not None:
            restored = {
                "step": client["step"],
                "note": client["note"],
                "best_loss": client["best_loss"].item(),
                "best_loss_is_tensor": torch.is_tensor(client["best_loss"]),
            }
        print("RESULT " + json.dumps({"losses": losses, "global_steps": engine.global_steps, "client": restored}))


if __name__ == "__main__":
    main()
