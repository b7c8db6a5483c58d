"""ms-swift's elastic restart, its own code run unmodified: ``prepare_deepspeed_elastic_config`` (and the helpers it
calls) from ms-swift's installed ``swift/trainers/utils.py`` on the TrainingArguments of an HF Trainer script, with
ms-swift's documented elastic DeepSpeed config (Elastic.md: ZeRO-1, ``elasticity`` version 0.1, max_train_batch_size
8, micro_batch_sizes [4, 2], 1-4 GPUs). It computes the batch for the world size through
``deepspeed.elasticity.compute_elastic_config`` and sets ``"checkpoint": {"load_universal": true}``; the resumed run
loads ``checkpoint-2`` through ``latest_universal``, as ms-swift's resume does.

ms-swift itself cannot be imported without its heavy dependencies (modelscope, ...), so the four functions are taken
from its source file by name and given the two plain names they read from the rest of ms-swift: a logger and
``get_dist_setting`` (rank, local rank, world size, local world size from the launcher's variables).

    zeroshard --as_deepspeed --num_gpus 2 ms_swift_elastic.py OUT_DIR
    zeroshard --as_deepspeed --num_gpus 1 ms_swift_elastic.py OUT_DIR --resume
"""

import ast
import importlib.util
import json
import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from hf_trainer import Tokens  # beside this script: the same tiny token dataset
from safetensors.torch import load_file
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

ELASTIC_FUNCTIONS = (
    "_get_deepspeed_elastic_world_size",
    "_enable_load_universal",
    "enable_deepspeed_load_universal",
    "prepare_deepspeed_elastic_config",
)


class _Logger(logging.LoggerAdapter):
    def warning_once(self, message):
        self.warning(message)

    def info_once(self, message):
        self.info(message)


def _get_dist_setting():
    env = os.environ
    return (int(env.get("RANK", -1)), int(env.get("LOCAL_RANK", -1)), int(env.get("WORLD_SIZE", 1)),
            int(env.get("LOCAL_WORLD_SIZE", 1)))  # fmt: skip


def ms_swift_functions() -> dict:
    """ms-swift's elastic functions, compiled from its installed source (``pip install --no-deps ms-swift``)."""
    spec = importlib.util.find_spec("swift")  # finds the package without running its __init__
    source_file = Path(spec.submodule_search_locations[0]) / "trainers" / "utils.py"
    tree = ast.parse(source_file.read_text(), str(source_file))
    wanted = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in ELASTIC_FUNCTIONS]
    assert [n.name for n in wanted] == list(ELASTIC_FUNCTIONS), [n.name for n in wanted]
    namespace = {"dist": dist, "logger": _Logger(logging.getLogger("swift"), {}), "get_dist_setting": _get_dist_setting}
    exec(compile(ast.Module(body=wanted, type_ignores=[]), str(source_file), "exec"), namespace)  # noqa: S102
    return namespace


def ds_config() -> dict:
    """ms-swift's default ZeRO-1 config for elastic training (docs/source_en/BestPractices/Elastic.md)."""
    return {
        "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
                 "hysteresis": 2, "min_loss_scale": 1},
        "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "none", "pin_memory": True},
                              "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": False,
                              "reduce_scatter": True, "reduce_bucket_size": 2e8, "contiguous_gradients": True},
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "steps_per_print": 2000,
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "wall_clock_breakdown": False,
        "elasticity": {"ignore_non_elastic_batch_info": True, "enabled": True, "max_train_batch_size": 8,
                       "micro_batch_sizes": [4, 2], "min_gpus": 1, "max_gpus": 4, "min_time": 20, "version": 0.1},
    }  # fmt: skip


class ResumedState(TrainerCallback):
    """At the start of training (after HF loaded the checkpoint): how far the model's weights are from the ones
    saved at step 2 (0.0: the resume restored them; a fresh initialization would be far) and the engine's step."""

    def __init__(self, saved: str):
        self.saved, self.found = saved, {}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        saved = load_file(f"{self.saved}/model.safetensors")
        params = dict(model.named_parameters())
        self.found["max_difference"] = max(float((params[n].detach() - t).abs().max()) for n, t in saved.items()
                                           if n in params)  # fmt: skip
        self.found["compared"] = sum(n in params for n in saved)


def main(out_dir: str, resume: bool) -> None:
    args = TrainingArguments(
        output_dir=out_dir,
        deepspeed=ds_config(),
        per_device_train_batch_size=1,  # ms-swift's example values: elasticity replaces them
        gradient_accumulation_steps=8,
        max_steps=4,
        save_steps=2,
        learning_rate=1e-2,
        logging_steps=1,
        report_to=[],
        seed=0,
    )
    if not dist.is_initialized():
        dist.init_process_group("gloo")  # what ms-swift's launch has done before its arguments are prepared
    ms_swift_functions()["prepare_deepspeed_elastic_config"](args)
    elastic = {"micro": args.per_device_train_batch_size, "accumulation": args.gradient_accumulation_steps,
               "load_universal": args.deepspeed["checkpoint"]["load_universal"]}  # fmt: skip
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=16))
    checkpoint = f"{out_dir}/checkpoint-2"
    resumed = ResumedState(checkpoint)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[resumed] if resume else [])
    universal = (Path(checkpoint) / "latest_universal").read_text() if resume else None
    trainer.train(resume_from_checkpoint=checkpoint if resume else None)
    if trainer.is_world_process_zero():
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        written = (Path(checkpoint) / "latest_universal").read_text()
        print("RESULT " + json.dumps({"global_step": trainer.state.global_step, "losses": losses, "elastic": elastic,
                                      "universal_tag": universal or written, "resumed": resumed.found,
                                      "engine_steps": trainer.model_wrapped.global_steps,
                                      "world": dist.get_world_size()}))  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1], "--resume" in sys.argv)
