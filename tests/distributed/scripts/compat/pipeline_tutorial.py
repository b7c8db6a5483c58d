"""DeepSpeed's pipeline tutorial (docs/_tutorials/pipeline.md, DeepSpeedExamples' training/pipeline_parallelism),
written against `deepspeed.*` only: an AlexNet-style network flattened into layers (an in-place ReLU first on a
stage, a lambda between layers), `PipelineModule(layers=..., num_stages=...)`, `deepspeed.initialize(...,
training_data=...)` and `engine.train_batch()` with no iterator. Run unmodified:
`zeroshard --as_deepspeed --num_gpus 2 pipeline_tutorial.py --deepspeed_config pipeline_ds_config.json -p 2`."""

import argparse
import json

import deepspeed
import torch
import torch.nn as nn
from deepspeed.pipe import PipelineModule


class AlexNetStyle(nn.Module):
    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=2),
            nn.Conv2d(8, 16, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=2),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((2, 2))
        self.classifier = nn.Sequential(nn.Linear(16 * 2 * 2, 32), nn.ReLU(inplace=True), nn.Linear(32, num_classes))

    def to_layers(self):
        return [*self.features, self.avgpool, lambda x: torch.flatten(x, 1), *self.classifier]


def dataset(n: int = 128):
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 10, (n,), generator=g)
    images = torch.randn(n, 3, 16, 16, generator=g) + labels.view(-1, 1, 1, 1) * 0.3
    return torch.utils.data.TensorDataset(images, labels)


def main() -> None:
    parser = argparse.ArgumentParser(description="pipeline tutorial")
    parser.add_argument("--local_rank", type=int, default=-1, help="passed by DeepSpeed's launcher")
    parser.add_argument("-p", "--pipeline-parallel-size", type=int, default=2)
    parser.add_argument("-s", "--steps", type=int, default=6)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    net = PipelineModule(
        layers=AlexNetStyle().to_layers(),
        loss_fn=torch.nn.CrossEntropyLoss(),
        num_stages=args.pipeline_parallel_size,
        partition_method="parameters",
        activation_checkpoint_interval=0,
    )
    engine, _, _, _ = deepspeed.initialize(
        args=args, model=net, model_parameters=[p for p in net.parameters() if p.requires_grad], training_data=dataset()
    )
    losses = [engine.train_batch().item() for _ in range(args.steps)]
    if engine.global_rank == 0:
        print("RESULT " + json.dumps({"losses": losses, "stages": engine.num_stages, "parts": net.parts}), flush=True)


if __name__ == "__main__":
    main()
