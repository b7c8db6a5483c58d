"""diffusion-pipe's route through the pipeline engine, in compatibility mode (``import deepspeed`` is zeroshard's):
its patch of ``TrainSchedule.steps`` (the micro-batch loaded before the exchanges) changes the order the engine
runs, a replaced ``PipelineEngine._INSTRUCTION_MAP`` entry is the one called, ``_configure_optimizer`` gives the
engine its optimizer after ``initialize``, ``communication_data_type`` is set, and a LoRA-like model (frozen base
weights) trains as one process does; its resume (``save_checkpoint(exclude_frozen_parameters=True)`` with the loader
in ``client_state``, ``load_checkpoint(load_module_strict=False)``) continues exactly.

The cases here write the client's patches in the test. ``ZEROSHARD_TEST_DIFFUSION_PIPE`` (a diffusion-pipe checkout
or bare git directory) runs its own files instead: ``utils/pipeline.py`` (``ManualPipelineModule``) imported
unmodified, and ``train_schedule_steps``, ``broadcast_model`` and ``clip_grad_norm_`` from ``utils/patches.py`` by
their source, unmodified (the rest of that module imports the model repositories it vendors as git submodules,
HunyuanVideo and ComfyUI)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from zeroshard.testing import run_distributed

DIM, RANK, MICRO, GAS, LR, BATCHES = 8, 2, 2, 4, 1e-3, 3
SOURCE = os.environ.get("ZEROSHARD_TEST_DIFFUSION_PIPE")


class Lora(nn.Module):
    """A frozen base layer with a trainable low-rank update, on diffusion-pipe's (latents, timestep) tuples."""

    def __init__(self):
        super().__init__()
        self.base = nn.Linear(DIM, DIM).requires_grad_(False)
        self.a = nn.Parameter(torch.randn(RANK, DIM) * 0.3)
        self.b = nn.Parameter(torch.randn(DIM, RANK) * 0.3)

    def forward(self, inputs):
        x, t = inputs
        return x + torch.tanh(self.base(x) + (x @ self.a.T) @ self.b.T) * t, t


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, inputs):
        x, _ = inputs
        return self.proj(x)


def layers() -> list:
    torch.manual_seed(0)
    return [Lora() for _ in range(5)] + [Head()]


def loss_fn(pred, target):
    return torch.nn.functional.mse_loss(pred, target)


def batches(count: int, seed: int = 1) -> list[list]:
    """``count`` batches of ``GAS`` micro-batches, each ((latents, timestep), target)."""
    g = torch.Generator().manual_seed(seed)

    def micro_batch():
        latents, timestep = torch.randn(MICRO, DIM, generator=g), torch.rand(MICRO, 1, generator=g)
        return (latents, timestep), torch.randn(MICRO, DIM, generator=g)

    return [[micro_batch() for _ in range(GAS)] for _ in range(count)]


def reference() -> dict:
    """One process: the same layers in sequence, AdamW, the global norm clipped at 1.0 (diffusion-pipe's default)."""
    model = nn.Sequential(*layers())
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR)
    losses = []
    for batch in batches(BATCHES):
        total = 0.0
        for inputs, target in batch:
            loss = loss_fn(model(inputs), target)
            (loss / GAS).backward()
            total += loss.item() / GAS
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return {"losses": losses, "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


def get_optimizer(model_parameters):
    return torch.optim.AdamW(model_parameters, lr=LR)


def load_first(original):
    """The client's patch of ``TrainSchedule.steps`` (diffusion-pipe's, in effect): each step's loads first."""
    from deepspeed.runtime.pipe.schedule import LoadMicroBatch

    def steps(self):
        for cmds in original(self):
            loads = [c for c in cmds if isinstance(c, LoadMicroBatch)]
            yield loads + [c for c in cmds if not isinstance(c, LoadMicroBatch)]

    return steps


def train(module, directory: str, stop_after: int = BATCHES, resume: bool = False) -> dict:
    """diffusion-pipe's train.py calls on ``module``; saves after batch ``stop_after`` (and stops) or resumes."""
    import deepspeed
    from deepspeed.runtime.pipe.engine import PipelineEngine
    from deepspeed.runtime.pipe.schedule import ReduceGrads

    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
              "gradient_clipping": 1.0, "steps_per_print": 1}  # fmt: skip
    model_engine, optimizer, _, _ = deepspeed.initialize(model=module, config=config)
    model_engine._support_torch_style_backward = True
    params = [p for p in module.parameters() if p.requires_grad]
    model_engine._configure_optimizer(get_optimizer, params)
    optimizer = model_engine.optimizer
    model_engine.communication_data_type = torch.float32
    model_engine.lr_scheduler = torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0)
    run = []  # the instructions run, by the entries the client's wrapper sees
    original_map = dict(PipelineEngine._INSTRUCTION_MAP)

    def recording(kind, function):
        def entry(self, **kwargs):
            run.append(f"{kind.__name__}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})")
            return function(self, **kwargs)

        return entry

    def client_reduce_grads(self):
        run.append("client ReduceGrads")
        return original_map[ReduceGrads](self)

    PipelineEngine._INSTRUCTION_MAP = {k: recording(k, f) for k, f in original_map.items()}
    PipelineEngine._INSTRUCTION_MAP[ReduceGrads] = client_reduce_grads
    data = batches(BATCHES)
    start, client_state = 0, None
    if resume:
        _, client_state = model_engine.load_checkpoint(directory, load_module_strict=False)
        start = client_state["step"]
    losses = []
    for step in range(start, stop_after):
        model_engine.reset_activation_shape()
        losses.append(model_engine.train_batch(iter(data[step])).item())
    if not resume and stop_after < BATCHES:
        state = {"step": stop_after, "custom_loader": {"epoch": 1, "position": stop_after * GAS}}
        model_engine.save_checkpoint(directory, client_state=state, exclude_frozen_parameters=True)
    PipelineEngine._INSTRUCTION_MAP = original_map
    weights = {n: p.detach().clone() for n, p in module.named_parameters()}
    facts = {"stage": model_engine.stage_id, "peak": model_engine.peak_micro_batches_in_flight,
             "dtype": str(model_engine.communication_data_type), "client_state": client_state}  # fmt: skip
    model_engine.destroy()
    return {"losses": losses, "weights": weights, "run": run, "facts": facts}


def expected_run(stage: int, stages: int) -> list[str]:
    """The patched schedule's instructions of ``stage``, as the engine must run them (for one batch)."""
    from deepspeed.runtime.pipe.schedule import TrainSchedule

    return [repr(c) for cmds in TrainSchedule(GAS, stages, stage).steps() for c in cmds]


def client_route(directory: str) -> dict:
    import zeroshard

    zeroshard.install_as_deepspeed()
    import deepspeed
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.schedule import TrainSchedule

    TrainSchedule.steps = load_first(TrainSchedule.steps)  # as diffusion-pipe's apply_patches() assigns it
    broadcasts = []
    deepspeed.runtime.engine.DeepSpeedEngine._broadcast_model = lambda self: broadcasts.append(self.global_steps)
    module = PipelineModule(layers=layers(), num_stages=2, loss_fn=loss_fn, partition_method="uniform")
    whole = train(module, directory)
    module = PipelineModule(layers=layers(), num_stages=2, loss_fn=loss_fn, partition_method="uniform")
    first = train(module, directory, stop_after=2)
    module = PipelineModule(layers=layers(), num_stages=2, loss_fn=loss_fn, partition_method="uniform")
    resumed = train(module, directory, resume=True)
    expected = expected_run(whole["facts"]["stage"], 2)
    return {"whole": whole, "first": first, "resumed": resumed, "expected_run": expected, "broadcasts": broadcasts}


@pytest.fixture(scope="module")
def route(tmp_path_factory):
    return run_distributed(client_route, 2, str(tmp_path_factory.mktemp("dp")))


def check_route(results: list, expected: dict) -> None:
    for rank, result in enumerate(results):
        whole = result["whole"]
        assert max(abs(a - b) for a, b in zip(whole["losses"], expected["losses"])) <= 1e-6, whole["losses"]
        for name, value in whole["weights"].items():
            index, rest = name.split(".", 1)  # the pipeline names a layer by its index, as nn.Sequential does
            torch.testing.assert_close(value, expected["weights"][f"{index}.{rest}"], rtol=1e-5, atol=1e-6)
        # the resume: the frozen base weights were not saved, the loader's position came back with client_state
        assert result["first"]["losses"] + result["resumed"]["losses"] == pytest.approx(whole["losses"], abs=1e-7)
        assert result["resumed"]["facts"]["client_state"]["custom_loader"] == {"epoch": 1, "position": 8}
        for name, value in result["resumed"]["weights"].items():
            torch.testing.assert_close(value, whole["weights"][name], rtol=0, atol=0)
        assert whole["facts"]["dtype"] == "torch.float32" and whole["facts"]["peak"] == 2 - rank


def test_the_clients_schedule_and_instruction_map_run_and_train_as_one_process(route):
    check_route(route, reference())
    for rank, result in enumerate(route):
        run = result["whole"]["run"]
        batch = ["ReduceGrads()" if r == "client ReduceGrads" else r for r in run[: len(run) // BATCHES]]
        assert batch == result["expected_run"], rank  # the patched order, instruction by instruction
        loaded_first = ["LoadMicroBatch(buffer_id=0)", "RecvActivation(buffer_id=0)"]  # DeepSpeed's: the other way
        assert result["expected_run"][: rank + 1] == loaded_first[: rank + 1]
        assert run.count("client ReduceGrads") == BATCHES and "ReduceGrads()" not in run
        assert result["broadcasts"] == [0, 0, 0]  # the client's _broadcast_model, once per initialize


def test_a_schedule_that_would_deadlock_is_refused_on_every_rank_before_anything_runs():
    results = run_distributed(deadlocking_schedule, 2)
    for rank, (message, loss) in enumerate(results):
        assert "TrainSchedule cannot run: the schedule deadlocks" in message, message
        assert f"rank {rank}" in message and loss > 0  # the engine is untouched: the next batch trains


def deadlocking_schedule():
    import zeroshard

    zeroshard.install_as_deepspeed()
    import deepspeed
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.schedule import RecvGrad, TrainSchedule

    module = PipelineModule(layers=layers(), num_stages=2, loss_fn=loss_fn)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
              "optimizer": {"type": "AdamW", "params": {"lr": LR}}}  # fmt: skip
    engine, *_ = deepspeed.initialize(model=module, config=config)
    original = TrainSchedule.steps

    def receive_first(self):  # every stage but the last waits for a gradient before sending anything
        if self.stage_id < self.stages - 1:
            yield [RecvGrad(0)]
        yield from original(self)

    TrainSchedule.steps = receive_first
    try:
        engine.train_batch(iter(batches(1)[0]))
        message = "ran"
    except Exception as error:
        message = str(error)
    TrainSchedule.steps = original
    loss = engine.train_batch(iter(batches(1)[0])).item()
    engine.destroy()
    return message, loss


# -- diffusion-pipe's own files (ZEROSHARD_TEST_DIFFUSION_PIPE) ----------------------------------------------------


def client_file(path: str) -> str:
    """The text of ``path`` in the diffusion-pipe checkout (or bare git directory) ``SOURCE``."""
    root = Path(SOURCE)
    if (root / path).is_file():
        return (root / path).read_text()
    return subprocess.run(["git", f"--git-dir={root}", "show", f"HEAD:{path}"], capture_output=True, text=True,
                          check=True).stdout  # fmt: skip


def their_patches() -> dict:
    """``utils/patches.py``'s imports of torch and DeepSpeed, ``train_schedule_steps`` and ``clip_grad_norm_``,
    executed from its source as written."""
    tree = ast.parse(client_file("utils/patches.py"))

    def imports_only_torch_or_deepspeed(node) -> bool:
        if isinstance(node, ast.ImportFrom):
            return (node.module or "").split(".")[0] in ("torch", "deepspeed")
        if isinstance(node, ast.Import):
            return all(a.name.split(".")[0] in ("torch", "deepspeed") for a in node.names)
        if isinstance(node, ast.Try):  # `from torch._six import inf` falling back to `from torch import inf`
            statements = node.body + [s for h in node.handlers for s in h.body]
            return all(imports_only_torch_or_deepspeed(s) for s in statements)
        return False

    wanted = ("train_schedule_steps", "clip_grad_norm_", "broadcast_model")
    keep = [node for node in tree.body if imports_only_torch_or_deepspeed(node)
            or (isinstance(node, ast.FunctionDef) and node.name in wanted)]  # fmt: skip
    namespace: dict = {}
    exec(compile(ast.Module(body=keep, type_ignores=[]), "utils/patches.py", "exec"), namespace)
    return namespace


def their_route(directory: str, source: str) -> dict:
    import importlib.util
    import tempfile

    import zeroshard

    zeroshard.install_as_deepspeed()
    import deepspeed

    global SOURCE
    SOURCE = source
    patches = their_patches()
    clip_grad_norm_ = patches["clip_grad_norm_"]
    # as their apply_patches() assigns them
    deepspeed.runtime.pipe.schedule.TrainSchedule.steps = patches["train_schedule_steps"]
    deepspeed.runtime.engine.DeepSpeedEngine.clip_fp32_gradients = lambda self: clip_grad_norm_(
        parameters=self.module.parameters(), max_norm=self.gradient_clipping(), mpu=self.mpu
    )
    broadcasts = []

    def broadcast_model(self):  # theirs, counted
        broadcasts.append(self.global_steps)
        return patches["broadcast_model"](self)

    deepspeed.runtime.engine.DeepSpeedEngine._broadcast_model = broadcast_model
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "pipeline.py").write_text(client_file("utils/pipeline.py"))
        spec = importlib.util.spec_from_file_location("diffusion_pipe_pipeline", Path(tmp, "pipeline.py"))
        pipeline = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(pipeline)

    def build():
        return pipeline.ManualPipelineModule(layers=layers(), num_stages=2, partition_method="manual",
                                             manual_partition_split=[4], loss_fn=loss_fn)  # fmt: skip

    whole = train(build(), directory)
    first = train(build(), directory, stop_after=2)
    resumed = train(build(), directory, resume=True)
    return {"whole": whole, "first": first, "resumed": resumed, "parts": build().parts, "broadcasts": broadcasts}


@pytest.mark.skipif(SOURCE is None, reason="set ZEROSHARD_TEST_DIFFUSION_PIPE to a diffusion-pipe checkout")
def test_diffusion_pipes_own_files_run_unmodified_and_train_as_one_process(tmp_path):
    results = run_distributed(their_route, 2, str(tmp_path), SOURCE)
    check_route(results, reference())
    for result in results:
        assert result["parts"] == [0, 4, 6] and result["broadcasts"] == [0, 0, 0]
        run = result["whole"]["run"]
        assert run[0].startswith("LoadMicroBatch") or result["whole"]["facts"]["stage"] == 1
        first_forward_step = [r for r in run if not r.startswith("client")][:3]
        if result["whole"]["facts"]["stage"] == 1:  # their order: load, then receive, then forward
            assert first_forward_step[:2] == ["LoadMicroBatch(buffer_id=0)", "RecvActivation(buffer_id=0)"]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
