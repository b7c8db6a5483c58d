"""The sweep of issue 40: every ``import deepspeed...`` / ``from deepspeed... import ...`` (and every attribute read
off an imported DeepSpeed module) in DeepSpeed's docs and tutorials and in the training stacks that call DeepSpeed
resolves in compatibility mode, and every DeepSpeed engine method those stacks call exists on zeroshard's engine.

The list is test data (``tests/fixtures/deepspeed_imports/client_imports.json``, written by ``collect.py`` beside
it from the projects' sources, each entry with where it was found). A name is either implemented or, for a feature
zeroshard does not build, importable and refused with ``NotImplementedError`` naming it when used: an
``ImportError`` would stop a client that merely imports the name. The check runs in a fresh interpreter, since
installing the alias changes the process."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "deepspeed_imports" / "client_imports.json"
SWEEP = json.loads(FIXTURE.read_text())

# ``.name`` matches of DeepSpeed engine method names in the clients that read another object, not the engine
NOT_ENGINE_CALLS = {
    "_configure_zero_optimizer": "accelerate: a comment describing DeepSpeed's initialize",
    "_get_ckpt_name": "ArcticTraining's MoE checkpoint patch, on DeepSpeed's checkpoint paths (expert parallelism)",
    "_get_optimizer_ckpt_name": "the same MoE checkpoint patch",
    "_get_model_parameters": "OpenRLHF's own strategy method",
    "_save_checkpoint": "the HF Trainer's and ms-swift's own method",
    "_save_moe_checkpoint": "ArcticTraining assigns its own onto DeepSpeedEngine (a patch); nothing reads ours",
    "load_moe_state_dict": "likewise assigned by ArcticTraining's MoE patch",
    "dataloader_drop_last": "TrainingArguments.dataloader_drop_last",
    "get_data_parallel_rank": "Megatron-LM's mpu (accelerate/utils/megatron_lm.py); diffusion-pipe's engine.grid",
    "get_model_parallel_rank": "diffusion-pipe's clip_grad_norm_ on the mpu (the pipeline grid has it)",
    "get_sequence_parallel_group": "the mpu object register_with_transformers returns (it has it)",
    "log_level": "TrainingArguments.log_level",
    "loss_scale": "Lightning's strategy attribute",
    "scale": "torch's GradScaler.scale",
    "zero_hpz_partition_size": "the clients' own arguments",
}
# attribute reads the collector matched textually that read another object of the same local name
NOT_IMPORTS = {
    "deepspeed.comm.comm.icdf": "diffusion-pipe's utils/common.py rebinds `dist` to a torch distribution locally",
}
# names of features zeroshard does not build: importable, refused when used
NOT_BUILT = [
    "deepspeed.runtime.pipe.p2p.send",  # qlora-pipe's engine subclass sends between stages itself
    "deepspeed.runtime.pipe.p2p.recv",
    "deepspeed.runtime.utils.PartitionedTensor",
    "deepspeed.ops.sparse_attention.SparseSelfAttention",
    "deepspeed.ops.sparse_attention.BertSparseSelfAttention",
    "deepspeed.ops.deepspeed4science.DS4Sci_EvoformerAttention",
    "deepspeed.ops.op_builder.AsyncIOBuilder",
    "deepspeed.ops.op_builder.GDSBuilder",
    "deepspeed.DeepSpeedTransformerLayer",
    "deepspeed.DeepSpeedTransformerConfig",
    "deepspeed.module_inject.layers.GatherReplacedLayerParams",
    "deepspeed.runtime.data_pipeline.curriculum_scheduler.CurriculumScheduler",  # gpt-neox imports it at module top
    "deepspeed.runtime.bf16_optimizer.BF16_Optimizer",
]


def run(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


RESOLVE = """
import importlib, json, zeroshard
zeroshard.install_as_deepspeed()

def resolve(dotted):
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part)
        return obj
    raise ModuleNotFoundError(dotted)
"""


def test_the_sweep_covers_the_named_stacks_and_the_issues_examples():
    assert {"DeepSpeed", "accelerate", "trl", "OpenRLHF", "axolotl", "LLaMA-Factory", "ArcticTraining", "ms-swift",
            "lightning", "open-instruct", "diffusion-pipe", "qlora-pipe"} <= set(SWEEP["sources"])  # fmt: skip
    assert any(k.startswith("transformers") for k in SWEEP["sources"])
    found = {(e["module"], e["name"]) for e in SWEEP["imports"]}
    for example in [
        ("deepspeed.runtime.utils", "move_to_device"),  # DeepSpeed's ALST tutorial
        ("deepspeed.utils.timer", "SynchronizedWallClockTimer"),  # ArcticTraining
        ("deepspeed.runtime.checkpoint_engine", "TorchCheckpointEngine"),
        ("deepspeed.elasticity", "compute_elastic_config"),  # ms-swift
        ("deepspeed.git_version_info", "version"),
        ("deepspeed.ops.adagrad", "DeepSpeedCPUAdagrad"),  # Accelerate
        ("deepspeed.runtime.pipe.schedule", "TrainSchedule"),  # diffusion-pipe patches its steps
        ("deepspeed.runtime.pipe.engine.PipelineEngine", "_INSTRUCTION_MAP"),  # and an entry of this
        ("deepspeed.runtime.pipe.schedule", "_is_even"),  # qlora-pipe
    ]:
        assert example in found, example


def test_every_name_the_clients_import_resolves():
    names = sorted({e["module"] + (f".{e['name']}" if e["name"] else "") for e in SWEEP["imports"]})
    assert set(NOT_IMPORTS) <= set(names)  # each exclusion names a real match, with its reason
    names = [n for n in names if n not in NOT_IMPORTS]
    found = run(
        RESOLVE
        + f"""
missing = []
for dotted in {names!r}:
    try:
        resolve(dotted)
    except Exception as err:
        missing.append(f"{{dotted}}: {{type(err).__name__}}: {{err}}")
print(json.dumps({{"missing": missing, "count": len({names!r})}}))
"""
    )
    assert found["missing"] == [] and found["count"] > 100


def test_names_of_features_not_built_import_and_refuse_when_used_naming_themselves():
    found = run(
        RESOLVE
        + f"""
outcome = {{}}
for dotted in {NOT_BUILT!r}:
    thing = resolve(dotted)
    try:
        thing(1, key=2)
        outcome[dotted] = "ran"
    except NotImplementedError as err:
        outcome[dotted] = str(err)
class Pipeline(resolve("deepspeed.ops.sparse_attention.SparseSelfAttention")):  # clients subclass them
    pass
try:
    Pipeline()
except NotImplementedError as err:
    outcome["subclass"] = str(err)
print(json.dumps(outcome))
"""
    )
    for dotted in NOT_BUILT:
        assert "not implemented by zeroshard" in found[dotted] and dotted.rsplit(".", 1)[1] in found[dotted], dotted
    assert "deepspeed.ops.sparse_attention.SparseSelfAttention is not implemented" in found["subclass"]


def test_every_engine_method_the_clients_call_exists():
    calls = sorted(SWEEP["engine_methods"])
    assert set(NOT_ENGINE_CALLS) <= set(calls)  # the exclusions name real matches, each with its reason
    wanted = [m for m in calls if m not in NOT_ENGINE_CALLS]
    from zeroshard.runtime import ZeroshardEngine

    assert "gradient_clipping" in wanted and "get_wall_clock_timers" in wanted
    assert [m for m in wanted if not hasattr(ZeroshardEngine, m)] == []


def test_each_entry_says_where_it_was_found():
    places = [p for e in SWEEP["imports"] for p in e["found_in"]] + [
        p for found in SWEEP["engine_methods"].values() for p in found
    ]
    assert places and all(p.count(":") >= 2 and p.split(":")[0] in SWEEP["sources"] for p in places)
