"""LightningCLI with a zeroshard strategy by name and DeepSpeed's CPU Adam by class path (as in a YAML config)."""

import lightning as L
import torch
from lightning.pytorch.cli import LightningCLI

import zeroshard.lightning  # noqa: F401  (registers the strategy names)


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 4)), batch_size=4)


if __name__ == "__main__":
    cli = LightningCLI(Model, save_config_kwargs={"overwrite": True})
    if cli.trainer.is_global_zero:
        optimizer = cli.trainer.optimizers[0]
        print(f'RESULT {{"optimizer": "{type(optimizer.optimizer).__name__}", "steps": {cli.trainer.global_step}}}')
