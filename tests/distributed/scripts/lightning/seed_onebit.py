"""The seed example's DeepSpeed configuration (1-bit Adam, WarmupLR, ZeRO stage 2 with CPU optimizer offload,
fp16) through ``zeroshard.lightning.ZeroshardStrategy(config=...)``, on 2 CPU processes under Lightning's own
launcher, with ``freeze_step`` lowered so the 1-bit phase starts within the run.

usage: seed_onebit.py STEPS FREEZE_STEP
Prints RESULT {...} on rank 0: per-step losses, when the 1-bit phase started, what the 1-bit collectives sent."""

import json
import sys

import lightning as L
import torch
import torch.nn.functional as F

from zeroshard.lightning import ZeroshardStrategy


def seed_config(freeze_step: int) -> dict:
    return {
        "zero_allow_untested_optimizer": True,
        "optimizer": {
            "type": "OneBitAdam",
            "params": {
                "lr": 3e-5,
                "betas": [0.998, 0.999],
                "eps": 1e-5,
                "weight_decay": 1e-9,
                "cuda_aware": True,
                "freeze_step": freeze_step,
            },
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"last_batch_iteration": -1, "warmup_min_lr": 0, "warmup_max_lr": 3e-5, "warmup_num_steps": 100},
        },
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu"},
            "contiguous_gradients": True,
            "overlap_comm": True,
            "allgather_bucket_size": 2e8,
            "reduce_bucket_size": 2e8,
        },
    }


class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.losses.append(loss.detach().float().item())
        return loss

    def configure_optimizers(self):
        return None  # the config's optimizer and scheduler blocks


def data(samples: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 16, generator=g)
    y = torch.tanh(x[:, :4]) + 3.0  # an offset far away: steady progress at lr 3e-5 and betas 0.998
    return torch.utils.data.TensorDataset(x, y)


def main() -> None:
    steps, freeze_step = int(sys.argv[1]), int(sys.argv[2])
    L.seed_everything(0)
    strategy = ZeroshardStrategy(config=seed_config(freeze_step))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        precision="16-mixed",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Regressor()
    loader = torch.utils.data.DataLoader(data(32), batch_size=8, shuffle=False)  # the same 2 batches per rank
    trainer.fit(model, loader)
    engine = strategy.engine
    ledger = {f"{op}/{group}": [t.calls, t.wire_bytes] for (op, group), t in engine.comm_ledger.totals.items()}
    if trainer.is_global_zero:
        result = {
            "losses": model.losses,
            "global_step": trainer.global_step,
            "compressed_from": engine.zero.compressed_from,
            "optimizer": type(engine.zero.optimizer).__name__,
            "loss_scale": engine.zero.loss_scale,
            "skipped_steps": engine.skipped_steps,
            "ledger": ledger,
            "lr": trainer.optimizers[0].param_groups[0]["lr"],
        }
        print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
