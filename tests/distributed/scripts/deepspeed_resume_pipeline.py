"""Run by ``tests/distributed/test_deepspeed_pipeline_import.py`` under torchrun with real DeepSpeed on PYTHONPATH
(never zeroshard's environment): DeepSpeed's pipeline engine builds the fixture's model (``layers.py``, also on
PYTHONPATH) at STAGES stages, resumes the universal folder OUT_DIR (``load_universal``) and trains 3 steps of the
fixture's global batches; rank 0 writes the losses to OUT.

    python -m torch.distributed.run --nproc_per_node=4 deepspeed_resume_pipeline.py DIR CONFIG_JSON STAGES OUT
"""

import json
import sys

import deepspeed
import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from layers import batches, cross_entropy, layer_specs

GAS = 4  # micro-batches per data-parallel rank at 2 data-parallel ranks (8 per step in all)


def main(folder: str, config_json: str, stages: int, out: str) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    world = torch.distributed.get_world_size()
    data_parallel = world // stages
    config = json.loads(config_json)
    config["gradient_accumulation_steps"] = 2 * GAS // data_parallel
    config["checkpoint"] = {"load_universal": True}
    torch.manual_seed(1)  # other weights than the checkpoint's until it loads
    module = PipelineModule(layer_specs(LayerSpec, TiedLayerSpec), num_stages=stages, loss_fn=cross_entropy)
    engine, *_ = deepspeed.initialize(model=module, model_parameters=module.parameters(), config=config)
    engine.load_checkpoint(folder)
    dp, gas = engine.grid.get_data_parallel_rank(), config["gradient_accumulation_steps"]
    losses = [engine.train_batch(iter(step[dp * gas : (dp + 1) * gas])).item() for step in batches(5, 2 * GAS)[2:]]
    if torch.distributed.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(losses, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
