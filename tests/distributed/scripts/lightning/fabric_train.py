"""Lightning Fabric with ZeroshardFabricStrategy (or Fabric's DDP): train, save, load.

usage: fabric_train.py OUT_DIR {ddp|zeroshard} [DEVICES]  -> RESULT {...} on rank 0

DEVICES 1 (ddp) is Fabric DDP's reference in one process: both ranks' halves of the data and the mean of their
losses; ``run(out_dir, mode, devices)`` returns the result instead of printing it."""

import json
import sys

import lightning as L
import torch
import torch.nn.functional as F

import zeroshard.lightning  # noqa: F401
from zeroshard.lightning import ZeroshardFabricStrategy


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 8, generator=g)
    return x, x @ torch.randn(8, 2, generator=g)


def run(out_dir: str, mode: str, devices: int = 2) -> dict:
    strategy = "ddp" if mode == "ddp" else ZeroshardFabricStrategy(stage=3, stage3_param_persistence_threshold=0)
    if devices == 1:
        assert mode == "ddp", "one device is DDP's reference"
        strategy = "auto"
    fabric = L.Fabric(accelerator="cpu", devices=devices, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    model, optimizer = fabric.setup(model, optimizer)
    x, y = data()
    per = 32 // devices
    shard = slice(fabric.global_rank * per, (fabric.global_rank + 1) * per)

    def train(steps: int) -> None:
        for _ in range(steps):
            loss = F.mse_loss(model(x[shard]), y[shard])
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()

    def full_loss() -> float:
        with torch.no_grad():
            return F.mse_loss(model(x), y).item()

    initial = full_loss()
    train(5)
    trained = full_loss()
    fabric.save(f"{out_dir}/ckpt", {"model": model, "optimizer": optimizer, "step": 5, "best": torch.tensor(trained)})
    train(3)
    moved = full_loss()
    state = {"model": model, "optimizer": optimizer, "step": 0}
    remainder = fabric.load(f"{out_dir}/ckpt", state)
    restored = full_loss()
    return {
        "initial": initial,
        "trained": trained,
        "moved": moved,
        "restored": restored,
        "step": state["step"],
        "best": float(remainder["best"]),
        "global_zero": fabric.global_rank == 0,
    }


if __name__ == "__main__":
    outcome = run(*sys.argv[1:3], *map(int, sys.argv[3:4]))
    if outcome.pop("global_zero"):
        print("RESULT " + json.dumps(outcome))
