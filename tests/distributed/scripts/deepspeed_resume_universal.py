"""Run by real DeepSpeed (never zeroshard), from test_deepspeed_universal: resume a universal folder zeroshard
exported, with the config the run trained with plus ``load_universal``, and write the next losses per rank.

    DS_ACCELERATOR=cpu PYTHONPATH=<DeepSpeed> python -m torch.distributed.run --standalone --nproc_per_node=2 \\
        deepspeed_resume_universal.py CHECKPOINT_DIR CONFIG_JSON STEPS OUT_JSON
"""

import importlib.util
import json
import sys
from pathlib import Path

import deepspeed
import torch

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "deepspeed_checkpoints"
spec = importlib.util.spec_from_file_location("ds_fixture_shapes", FIXTURES / "shapes.py")
shapes = importlib.util.module_from_spec(spec)
spec.loader.exec_module(shapes)

if __name__ == "__main__":
    directory, config, steps, out = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    deepspeed.init_distributed(dist_backend="gloo")
    assert "zeroshard" not in type(deepspeed.initialize).__module__
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(1)
    engine, *_ = deepspeed.initialize(model=shapes.Tiny(), config={**config, "checkpoint": {"load_universal": True}})
    path, client = engine.load_checkpoint(directory)
    losses = []
    for x, y in shapes.batches(rank, 2 + steps)[2:]:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    gathered = [torch.zeros(steps) for _ in range(world)]
    torch.distributed.all_gather(gathered, torch.tensor(losses))
    if rank == 0:
        Path(out).write_text(
            json.dumps(
                {
                    "path": path,
                    "losses": [t.tolist() for t in gathered],
                    "global_steps": engine.global_steps,
                    "client": client,
                }
            )
        )
    engine.destroy()
