"""A job that resumes by itself: ``OUT STAGE TOTAL_STEPS KILL_AT KILL`` trains the parity GPT from a dataset with
``checkpoint.auto_resume`` and a save every 2 steps, and writes the final weights from rank 0 to ``OUT/final.pt``.

At optimizer step ``KILL_AT`` (once: a marker file remembers) rank 1 dies by SIGKILL: ``KILL=rank`` kills the
rank alone, ``KILL=node`` its node's agent first (the whole node leaves). ``ELASTIC=1`` in the environment turns
on DeepSpeed's ``elasticity`` block (one global batch of 8 for 1 or 2 ranks)."""

import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

import zeroshard
from zeroshard import comm
from zeroshard.testing.parity import make_batches, make_model


def main(out: Path, stage: int, total: int, kill_at: int, kill: str) -> None:
    config = {
        "steps_per_print": 1000,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "checkpoint": {"save_dir": str(out / "ckpt"), "save_interval_steps": 2, "auto_resume": True},
    }
    if os.environ.get("ELASTIC") == "1":
        config["elasticity"] = {"enabled": True, "max_train_batch_size": 8, "micro_batch_sizes": [2], "max_gpus": 2}
    else:
        config["train_micro_batch_size_per_gpu"] = 2
    x, y = make_batches(1, 64)[0]
    engine, _, loader, _ = zeroshard.initialize(model=make_model(), config=config, training_data=TensorDataset(x, y))
    rank, world = comm.get_rank(), comm.get_world_size()
    print(
        f"rank {rank}: world {world}, batch {engine.train_batch_size()}, accumulation "
        f"{engine.gradient_accumulation_steps()}, resumed from {engine.resumed_from}, step {engine.global_steps}",
        flush=True,
    )
    marker = out / "killed"
    epoch, reported = loader.sampler.epoch, False
    while engine.global_steps < total:
        loader.sampler.set_epoch(epoch)
        for xb, yb in loader:
            engine.backward(engine(xb, yb))
            engine.step()
            if not reported and engine.was_step_applied():
                reported = True
                print(f"rank {rank}: first step at {time.time():.3f}", flush=True)
            if kill and rank == 1 and engine.global_steps == kill_at and not marker.exists():
                marker.write_text(f"{time.time():.3f}")
                if kill == "node":
                    os.kill(os.getppid(), signal.SIGKILL)  # the agent: this node leaves the job
                os.kill(os.getpid(), signal.SIGKILL)
            if engine.global_steps >= total:
                break
        epoch += 1
    state = engine.consolidated_state_dict()
    if rank == 0:
        torch.save({k: v.float() for k, v in state.items()}, out / "final.pt")
        print(f"done: step {engine.global_steps}, world {world}, samples {engine.global_samples}", flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(Path(args[0]), int(args[1]), int(args[2]), int(args[3]), args[4] if len(args) > 4 else "")
