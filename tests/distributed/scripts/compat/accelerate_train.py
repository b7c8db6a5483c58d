"""An Accelerate training loop, run the same way with DeepSpeed (zeroshard, stages 2/3) and with Accelerate's own
DDP path, to compare. `zeroshard --as_deepspeed --num_gpus 2 accelerate_train.py MODE OUT_DIR`, MODE one of ddp, ds2,
ds3, ds3nvme, ds3regional (Accelerate's regional compile: each repeated block compiled in place, its
use_regional_compilation), ds2compile (its dynamo_backend: engine.compile())."""

import json
import os
import sys

import torch
import torch.nn.functional as F
from accelerate import Accelerator, DeepSpeedPlugin
from accelerate.utils import TorchDynamoPlugin
from torch._dynamo.utils import counters


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    y = x @ torch.randn(8, 2, generator=g) + 0.1 * torch.randn(64, 2, generator=g)
    return torch.utils.data.TensorDataset(x, y)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x):
        return x + torch.tanh(self.linear(x))


class Net(torch.nn.Module):
    """Two repeated blocks in a ModuleList: what Accelerate's regional compile looks for."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(2))
        self.out = torch.nn.Linear(16, 2)

    def forward(self, x):
        x = torch.tanh(self.inp(x))
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def full_loss(model, dataset) -> float:
    x, y = dataset.tensors
    with torch.no_grad():
        return F.mse_loss(model(x), y).item()


def compiled_blocks(model) -> list[str]:
    """The modules compiled in place (``nn.Module.compile``) inside the prepared model."""
    inner = getattr(model, "module", model)
    return [name for name, m in inner.named_modules() if getattr(m, "_compiled_call_impl", None) is not None]


def main(mode: str, out_dir: str) -> None:
    if mode == "ddp":
        accelerator = Accelerator(gradient_accumulation_steps=2, cpu=True)
    elif mode == "ds3nvme":  # ZeRO-Infinity through Accelerate's flags (its config file's offload_*_device: nvme)
        swap = os.path.join(out_dir, "nvme")
        os.makedirs(swap, exist_ok=True)
        plugin = DeepSpeedPlugin(
            zero_stage=3,
            gradient_accumulation_steps=2,
            zero3_save_16bit_model=True,
            offload_optimizer_device="nvme",
            offload_param_device="nvme",
            offload_optimizer_nvme_path=swap,
            offload_param_nvme_path=swap,
        )
        accelerator = Accelerator(deepspeed_plugin=plugin)
    else:
        stage = int(mode[2])
        plugin = DeepSpeedPlugin(zero_stage=stage, gradient_accumulation_steps=2, zero3_save_16bit_model=True)
        dynamo = None
        if mode.endswith("compile") or mode.endswith("regional"):
            dynamo = TorchDynamoPlugin(backend="inductor", use_regional_compilation=mode.endswith("regional"))
        accelerator = Accelerator(deepspeed_plugin=plugin, dynamo_plugin=dynamo)
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dataset = data()
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    def epoch() -> None:
        for x, y in loader:
            with accelerator.accumulate(model):
                accelerator.backward(F.mse_loss(model(x), y))
                if accelerator.sync_gradients:  # under DeepSpeed the engine clips (gradient_clipping 1.0)
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()

    epoch()
    epoch()
    final = full_loss(model, dataset)
    accelerator.save_state(f"{out_dir}/state")
    epoch()  # move away from the saved state ...
    moved = full_loss(model, dataset)
    accelerator.load_state(f"{out_dir}/state")  # ... and back
    restored = full_loss(model, dataset)
    weights = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        total = sum(v.double().sum().item() for v in weights.values())
        print(
            "RESULT "
            + json.dumps(
                {
                    "final": final,
                    "moved": moved,
                    "restored": restored,
                    "weights_sum": total,
                    "distributed_type": str(accelerator.distributed_type),
                    "processes": accelerator.num_processes,
                    "compiled": compiled_blocks(model),
                    "graph_breaks": sum(counters["graph_break"].values()),
                }
            )
        )
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
