"""A DeepSpeed tutorial-style image classifier (after DeepSpeedExamples' cifar10_deepspeed.py), written against
`deepspeed.*` only. Run unmodified: `zeroshard --as_deepspeed --num_gpus 2 cifar_style.py --deepspeed
--deepspeed_config ds_config.json`. Synthetic 3x16x16 "images" stand in for CIFAR (no download)."""

import argparse
import json

import deepspeed
import torch
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 4 * 4, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(torch.flatten(x, 1))


def dataset(n: int = 256):
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 10, (n,), generator=g)
    images = torch.randn(n, 3, 16, 16, generator=g) + labels.view(-1, 1, 1, 1) * 0.3  # learnable
    return torch.utils.data.TensorDataset(images, labels)


def main() -> None:
    parser = argparse.ArgumentParser(description="CIFAR-style")
    parser.add_argument("--local_rank", type=int, default=-1, help="passed by DeepSpeed's launcher")
    parser.add_argument("--epochs", type=int, default=2)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    deepspeed.init_distributed()
    torch.manual_seed(0)
    net = Net()
    parameters = {"params": [p for p in net.parameters() if p.requires_grad], "name": "parameters"}
    parameters = split_params_into_different_moe_groups_for_optimizer(parameters)
    engine, optimizer, trainloader, _ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=dataset()
    )
    device = get_accelerator().device_name(engine.local_rank)
    criterion = nn.CrossEntropyLoss()
    losses = []
    for _ in range(args.epochs):
        for inputs, labels in trainloader:
            outputs = engine(inputs.to(device))
            loss = criterion(outputs, labels.to(device))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    deepspeed.comm.barrier()
    total = torch.tensor([sum(losses[-4:])])
    deepspeed.comm.all_reduce(total)
    per_step = torch.tensor(losses)  # each step's loss over the global batch: the mean of the ranks' means
    deepspeed.comm.all_reduce(per_step)
    if deepspeed.comm.get_rank() == 0:
        memory = get_accelerator().memory_allocated()
        print(
            "RESULT "
            + json.dumps(
                {
                    "first": losses[0],
                    "last4_mean_all_ranks": total.item() / (4 * deepspeed.comm.get_world_size()),
                    "losses": (per_step / deepspeed.comm.get_world_size()).tolist(),
                    "steps": engine.global_steps,
                    "memory_allocated": memory,
                    "device": device,
                    "backend": get_accelerator().communication_backend_name(),
                }
            )
        )


if __name__ == "__main__":
    main()
