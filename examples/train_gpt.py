"""Train a small GPT on a shipped text (byte tokens) with zeroshard.

    zeroshard --num_gpus 2 examples/train_gpt.py --deepspeed_config examples/configs/stage2.json

With ``examples/configs/stage2_elastic.json`` it saves every 10 steps and resumes by itself
(``checkpoint.auto_resume``) and keeps one global batch on 1, 2 or 4 ranks (``elasticity``), so an elastic
launch survives a lost rank or node:

    zeroshard --num_gpus 2 --max_restarts 3 examples/train_gpt.py \\
        --deepspeed_config examples/configs/stage2_elastic.json

Prints the loss as it falls and a final summary: tokens/s, bytes communicated, peak memory per rank.
"""

import argparse
import time
from pathlib import Path

import torch
from tqdm import tqdm

import zeroshard
from zeroshard import comm
from zeroshard.testing.models import GPT, GPTConfig

CORPUS = Path(__file__).parent / "data" / "corpus.txt"


class ByteWindows(torch.utils.data.Dataset):
    """Fixed-length windows of the corpus as byte tokens; targets are the next byte."""

    def __init__(self, text: bytes, block: int):
        self.data = torch.tensor(list(text), dtype=torch.long)
        self.block = block

    def __len__(self):
        return len(self.data) - self.block - 1

    def __getitem__(self, i):
        chunk = self.data[i : i + self.block + 1]
        return chunk[:-1], chunk[1:]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--n_layer", type=int, default=4)
    parser.add_argument("--n_embd", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no_progress", action="store_true", help="no progress bar (rank 0, on stderr)")
    zeroshard.add_config_arguments(parser)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd)
    model = GPT(cfg)
    dataset = ByteWindows(CORPUS.read_bytes(), cfg.block_size)
    engine, _, loader, _ = zeroshard.initialize(args=args, model=model, training_data=dataset)
    rank, world = comm.get_rank(), comm.get_world_size()
    if rank == 0:
        print(
            f"model: {model.num_params() / 1e6:.2f}M parameters, {world} rank(s), "
            f"ZeRO stage {engine.zero_optimization_stage()}, global batch {engine.train_batch_size()}"
        )

    # a resumed run (checkpoint.auto_resume) continues in the epoch and at the sample where its checkpoint was
    tokens, started, epoch = 0, time.perf_counter(), loader.sampler.epoch
    bar = tqdm(total=args.steps, desc="train", unit="step", disable=rank != 0 or args.no_progress)
    while engine.global_steps < args.steps:
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            tokens += x.numel()
            if engine.global_steps > bar.n:
                bar.update(engine.global_steps - bar.n)
                bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
            if engine.global_steps >= args.steps:
                break
        epoch += 1
    bar.close()
    elapsed = time.perf_counter() - started

    # gather each rank's numbers with one all-reduce of a slot per rank
    stats = torch.zeros(3, world, dtype=torch.float64)
    stats[0, rank] = tokens
    stats[1, rank] = engine.comm_ledger.total_wire_bytes()
    stats[2, rank] = zeroshard.accelerator.get_accelerator().max_memory_allocated()
    comm.all_reduce(stats, engine.mesh.world)
    if rank == 0:
        print(f"final loss {loss.item():.4f} after {engine.global_steps} steps in {elapsed:.1f}s")
        print(f"tokens/s (all ranks): {stats[0].sum().item() / elapsed:,.0f}")
        print(
            f"bytes communicated per rank: {stats[1].mean().item() / 1e6:.1f} MB "
            f"({stats[1].mean().item() / engine.global_steps / 1e6:.2f} MB/step)"
        )
        print(
            "peak memory per rank (RSS on CPU): "
            + ", ".join(f"rank {r}: {stats[2, r].item() / 2**20:.0f} MiB" for r in range(world))
        )
        print(
            "model-state bytes on rank 0: "
            + ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in engine.state_bytes().items())
        )


if __name__ == "__main__":
    main()
