"""A complete, clean training script: init, a few steps, save, load, print, end. It never calls destroy():
zeroshard must tear itself down so that every rank exits 0. Rank 0 keeps computing after the others returned."""

import sys
import time

import torch

import zeroshard
from zeroshard.testing.parity import make_batches, make_model

checkpoint_dir, stage = sys.argv[1], int(sys.argv[2])
config = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": stage, "overlap_comm": True},
    "steps_per_print": 1000,
}
engine, *_ = zeroshard.initialize(model=make_model(), config=config)
for x, y in make_batches(3, 2):
    engine.backward(engine(x, y))
    engine.step()
engine.save_checkpoint(checkpoint_dir)
engine.load_checkpoint(checkpoint_dir)
if engine.global_rank == 0:
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:  # still busy while the other ranks have already returned
        torch.randn(64, 64) @ torch.randn(64, 64)
print(f"rank {engine.global_rank} finished")
