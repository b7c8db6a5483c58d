"""Train the parity GPT three steps and save the final weights from rank 0 (``OUT STAGE``): the same job however
its ranks are spread over nodes."""

import os
import sys

import torch

import zeroshard
from zeroshard import comm
from zeroshard.testing.parity import make_batches, make_model


def main(out: str, stage: int) -> None:
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 1000,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    engine, *_ = zeroshard.initialize(model=make_model(), config=config)
    rank, world = comm.get_rank(), comm.get_world_size()
    for x, y in make_batches(3, world * 2):
        rows = slice(rank * 2, rank * 2 + 2)
        engine.backward(engine(x[rows], y[rows]))
        engine.step()
    state = engine.consolidated_state_dict()
    print(f"rank {rank} of {world}, node {os.environ.get('GROUP_RANK')}", flush=True)
    if rank == 0:
        torch.save({k: v.float() for k, v in state.items()}, out)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
