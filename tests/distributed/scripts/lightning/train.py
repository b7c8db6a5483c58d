"""A Lightning training script run under Lightning's own launcher (2 CPU processes) with a chosen strategy.

usage: train.py OUT_DIR STRATEGY [--precision P] [--epochs N] [--resume CKPT] [--cpu_adam] [--constant_lr]
                [--devices N]
STRATEGY: ddp | a registered zeroshard name | class3 (ZeroshardStrategy(stage=3), every parameter sharded)
Prints RESULT {...} on rank 0: the full-data loss after training, the last step's gradient norm before clipping (the
engine's, or under DDP the averaged gradients' measured before the step), the paths. ``--devices 1`` (STRATEGY ddp)
is DDP's reference in one process: the batch of both ranks and the mean of their losses. Lightning shuffles the
training data of a distributed run (a ``DistributedSampler``, seed 0 plus the epoch) and deals rank r the samples
at r, r + 2, ... of that permutation, so the two ranks' k-th batches of 4 are its k-th 8: one process reads the same
permutation in batches of 8. ``fit(argv)`` returns the result instead of printing it."""

import argparse
import json
import os

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint

import zeroshard.lightning  # noqa: F401  (registers the "zeroshard*" strategy names)
from zeroshard.lightning import ZeroshardStrategy
from zeroshard.ops.adam import DeepSpeedCPUAdam


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    y = x @ torch.randn(8, 2, generator=g) * 3 + 0.1 * torch.randn(64, 2, generator=g)
    return torch.utils.data.TensorDataset(x, y)


class Regressor(L.LightningModule):
    def __init__(
        self,
        hidden: int = 16,
        lr: float = 0.02,
        cpu_adam: bool = False,
        config_optimizer: bool = False,
        constant_lr: bool = False,
        skip_first: int = 0,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.grad_norm = None
        self.skipped = 0
        self.net = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 2))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self):
        if self.hparams.config_optimizer:
            return None  # the strategy's config has an "optimizer" block
        cls = DeepSpeedCPUAdam if self.hparams.cpu_adam else torch.optim.AdamW
        optimizer = cls(self.parameters(), lr=self.hparams.lr, weight_decay=0.0)
        if self.hparams.constant_lr:  # what the config-block run does: AdamW at lr 0.02, no scheduler
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 4, gamma=0.5)}

    def full_data_loss(self) -> float:
        x, y = data().tensors
        with torch.no_grad():
            return F.mse_loss(self(x.to(self.dtype_of_inputs())), y).float().item()

    def dtype_of_inputs(self):
        return next(p.dtype for p in self.parameters())

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        """``skip_first``: the first steps run forward and backward but do not update, as an fp16 engine's first
        steps do while its loss scale comes down from 2^16 (the DDP reference of a 16-mixed run)."""
        if self.skipped < self.hparams.skip_first:
            optimizer_closure()
            optimizer.zero_grad()
            self.skipped += 1
            return
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)

    def on_before_optimizer_step(self, optimizer):
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if grads:  # DDP: the averaged, accumulated gradients, before Lightning clips them
            self.grad_norm = torch.nn.utils.get_total_norm(grads).item()

    def on_train_start(self):
        self.initial_loss = self.full_data_loss()

    def on_train_end(self):
        self.full_loss = self.full_data_loss()


def fit(argv=None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("strategy")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--cpu_adam", action="store_true")
    parser.add_argument("--config_optimizer", action="store_true", help="optimizer from the config block")
    parser.add_argument("--constant_lr", action="store_true", help="no LR scheduler (the config-block run's)")
    parser.add_argument("--skip_first", type=int, default=0, help="optimizer steps skipped at the start")
    parser.add_argument("--devices", type=int, default=2, choices=(1, 2), help="1: DDP's reference in one process")
    args = parser.parse_args(argv)

    L.seed_everything(0)
    if args.config_optimizer:
        config = {
            "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.0}},
            "zero_optimization": {"stage": 2},
        }
        strategy = ZeroshardStrategy(config=config)
    elif args.strategy == "class3":
        strategy = ZeroshardStrategy(stage=3, stage3_param_persistence_threshold=0)
    elif args.devices == 1:
        assert args.strategy == "ddp", "one device is DDP's reference"
        strategy = "auto"
    else:
        strategy = args.strategy
    checkpoints = ModelCheckpoint(dirpath=f"{args.out_dir}/ckpt", save_top_k=-1, every_n_epochs=1)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        precision=args.precision,
        max_epochs=args.epochs,
        accumulate_grad_batches=2,
        gradient_clip_val=0.5,  # small: it clips on most steps
        callbacks=[checkpoints],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Regressor(
        cpu_adam=args.cpu_adam,
        config_optimizer=args.config_optimizer,
        constant_lr=args.constant_lr,
        skip_first=args.skip_first,
    )
    loader = torch.utils.data.DataLoader(data(), batch_size=4, shuffle=False)
    if args.devices == 1:  # DDP's order: the distributed sampler's permutation, both ranks' batches at once
        sampler = torch.utils.data.DistributedSampler(data(), num_replicas=1, rank=0, shuffle=True, seed=0)
        loader = torch.utils.data.DataLoader(data(), batch_size=8, sampler=sampler)
    trainer.fit(model, loader, ckpt_path=args.resume)
    trainer.save_checkpoint(f"{args.out_dir}/final.ckpt")
    engine = getattr(trainer.strategy, "engine", None)
    return {
        "full_loss": model.full_loss,
        "initial_loss": model.initial_loss,
        "global_step": trainer.global_step,
        "checkpoints": sorted(os.listdir(f"{args.out_dir}/ckpt")),
        "lr": trainer.optimizers[0].param_groups[0]["lr"],
        "skipped_steps": engine.skipped_steps if engine is not None else model.skipped,
        "grad_norm": engine.get_global_grad_norm() if engine is not None else model.grad_norm,
        "global_zero": trainer.is_global_zero,
    }


def main() -> None:
    outcome = fit()
    if outcome.pop("global_zero"):
        print("RESULT " + json.dumps(outcome))


if __name__ == "__main__":
    main()
