"""Checkpoint save/load throughput against the disk's sequential bandwidth, measured in the same run.

    python benchmarks/checkpoint_io.py [--world 2] [--n_layer 6] [--n_embd 1024] [--dir /tmp/zs-ckpt-bench]

Trains one step (so Adam state exists), saves and loads a ZeRO-2 checkpoint, and writes/reads the same
number of bytes with plain sequential I/O + fsync as the baseline. Loads read from the page cache
unless the machine's memory is smaller than the checkpoint; the baseline read does too.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time

import torch

from zeroshard.testing import run_distributed
from zeroshard.testing.models import GPT, GPTConfig


def worker(cfg: GPTConfig, directory: str):
    import zeroshard
    from zeroshard import comm

    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 2},
    }
    engine, _, _, _ = zeroshard.initialize(model=GPT(cfg), config=config)
    x = torch.randint(0, cfg.vocab_size, (1, 9))
    engine.backward(engine(x[:, :-1], x[:, 1:]))
    engine.step()
    comm.barrier(engine.mesh.world)
    started = time.perf_counter()
    path = engine.save_checkpoint(directory, tag="bench")
    save_s = time.perf_counter() - started
    started = time.perf_counter()
    engine.load_checkpoint(directory, tag="bench")
    load_s = time.perf_counter() - started
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    return save_s, load_s, size


def sequential_baseline(directory: str, nbytes: int) -> tuple[float, float]:
    block = os.urandom(64 << 20)
    path = os.path.join(directory, "baseline.bin")
    started = time.perf_counter()
    with open(path, "wb") as f:
        written = 0
        while written < nbytes:
            written += f.write(block[: min(len(block), nbytes - written)])
        f.flush()
        os.fsync(f.fileno())
    write_s = time.perf_counter() - started
    started = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass
    read_s = time.perf_counter() - started
    os.remove(path)
    return write_s, read_s


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--n_layer", type=int, default=6)
    parser.add_argument("--n_embd", type=int, default=1024)
    parser.add_argument("--dir", default="/tmp/zs-ckpt-bench")
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    cfg = GPTConfig(vocab_size=4096, block_size=64, n_layer=args.n_layer, n_head=8, n_embd=args.n_embd)
    save_s, load_s, size = run_distributed(worker, args.world, cfg, args.dir, timeout_s=3600)[0]
    write_s, read_s = sequential_baseline(args.dir, size)
    gb = size / 1e9
    print(f"checkpoint {gb:.2f} GB ({args.world} ranks, ZeRO-2, fp32 master + Adam state + RNG)")
    print("| operation | seconds | GB/s | ratio to sequential disk I/O |")
    print("|---|---|---|---|")
    print(f"| zeroshard save | {save_s:.2f} | {gb / save_s:.2f} | {write_s / save_s:.2f} |")
    print(f"| sequential write + fsync | {write_s:.2f} | {gb / write_s:.2f} | 1.00 |")
    print(f"| zeroshard load | {load_s:.2f} | {gb / load_s:.2f} | {read_s / load_s:.2f} |")
    print(f"| sequential read | {read_s:.2f} | {gb / read_s:.2f} | 1.00 |")
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
