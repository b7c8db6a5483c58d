"""Hand Lightning's checkpoint paths a pickle whose object would create a file when unpickled.

usage: hostile_checkpoint.py DIR
Writes DIR/evil.ckpt, then tries it through ``Trainer(strategy=ZeroshardStrategy()).fit(ckpt_path=...)`` and
``Fabric(strategy=ZeroshardFabricStrategy()).load(...)`` (one CPU process each). Prints RESULT {...}: each path's
error (type and message) and whether the file the pickle would create exists."""

import json
import os
import sys

import lightning as L
import torch

from zeroshard.lightning import ZeroshardFabricStrategy, ZeroshardStrategy

sys.path.insert(0, os.path.dirname(__file__))
from train import Regressor, data  # noqa: E402


class Payload:
    """Unpickling this calls ``open(marker, "w")``: code from the checkpoint runs."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def attempt(action) -> str:
    try:
        action()
    except Exception as err:  # what matters is that it failed and what it said
        return f"{type(err).__name__}: {err}"
    return "loaded"


def main(directory: str) -> None:
    marker = os.path.join(directory, "PWNED")
    evil = os.path.join(directory, "evil.ckpt")
    torch.save({"state_dict": {}, "payload": Payload(marker)}, evil)

    def trainer_fit():
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            strategy=ZeroshardStrategy(stage=2),
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        loader = torch.utils.data.DataLoader(data(), batch_size=4)
        trainer.fit(Regressor(), loader, ckpt_path=evil)

    def fabric_load():
        fabric = L.Fabric(accelerator="cpu", devices=1, strategy=ZeroshardFabricStrategy(stage=2))
        fabric.launch()
        model = Regressor()
        model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=0.01))
        fabric.load(evil, {"model": model, "optimizer": optimizer})

    result = {"trainer": attempt(trainer_fit), "fabric": attempt(fabric_load), "ran": os.path.exists(marker)}
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
