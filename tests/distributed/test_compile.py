"""``engine.compile()``: each gather unit (stage 3) or repeated block (stages 0-2) compiled in place with zeroshard's
hooks outside. Against the same engine run eagerly, 5 steps within fp32 1e-5 at stages 0-3, with tensor
parallelism, activation checkpointing and offload, every collective counted alike (the tensor-parallel ones run inside
the graphs as custom operators); no graph break inside a unit (dynamo's own counters); recompiles
bounded when the sequence length changes; checkpoints interchangeable between compiled and eager runs; the calls
clients make (DeepSpeed's spelling, twice, after steps) and the hostile ones."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from zeroshard.testing import run_distributed
from zeroshard.testing.parity import relative_error

STEPS, MICRO = 5, 2


class EmbeddingFirst(nn.Module):
    """The embedding is the first module called, in the root unit: the model the stage-3 compile crash was found on
    (dynamo followed the root's gather hook into a parameter that was still sharded)."""

    def __init__(self, vocab: int = 64, width: int = 32):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            for _ in range(3)
        )
        self.head = nn.Linear(width, vocab)

    def forward(self, idx, targets):
        x = self.emb(idx)
        for block in self.blocks:
            x = x + block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def _gpt(checkpointed: bool = False):
    from zeroshard.testing.models import recompute_blocks
    from zeroshard.testing.parity import make_model

    model = make_model()
    return recompute_blocks(model) if checkpointed else model


def _hf(family: str):
    from zeroshard.testing.hf import tiny_causal_lm

    torch.manual_seed(0)
    return tiny_causal_lm(family)


# name -> (model, zero_optimization, more config, backend); the eager run of each is its reference
CASES = {
    "stage0": (_gpt, {"stage": 0}, {}, "aot_eager"),
    "stage1": (_gpt, {"stage": 1}, {}, "aot_eager"),
    "stage2": (_gpt, {"stage": 2}, {}, "aot_eager"),
    "stage3": (_gpt, {"stage": 3}, {}, "inductor"),
    "stage3_embedding_first": (EmbeddingFirst, {"stage": 3}, {}, "inductor"),
    "stage3_tensor_parallel": (
        lambda: _hf("llama"),
        {"stage": 3},
        {"tensor_parallel": {"autotp_size": 2}},
        "aot_eager",
    ),
    "stage3_expert_parallel": (
        lambda: _hf("mixtral"),
        {"stage": 3},
        {"expert_parallel": {"enabled": True, "autoep_size": 2, "preset_model": "mixtral"}},
        "aot_eager",
    ),
    "stage3_checkpointing": (lambda: _gpt(checkpointed=True), {"stage": 3}, {}, "aot_eager"),
    "stage3_offload": (
        _gpt,
        {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}},
        {},
        "aot_eager",
    ),
    "stage2_offload": (_gpt, {"stage": 2, "offload_optimizer": {"device": "cpu"}}, {}, "aot_eager"),
}


def _config(zero: dict, more: dict) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage3_param_persistence_threshold": 0, **zero},
        "steps_per_print": 10**9,
        **more,
    }


def _batches(steps: int = STEPS, seq: int = 8):
    generator = torch.Generator().manual_seed(1)
    return [tuple(torch.randint(0, 64, (2, MICRO, seq), generator=generator)) for _ in range(steps)]


def _step(engine, idx, targets) -> float:
    if hasattr(engine.module, "blocks"):
        loss = engine(idx, targets)
    else:  # a Hugging Face causal LM
        loss = engine(input_ids=idx, labels=targets).loss
    engine.backward(loss)
    engine.step()
    return loss.item()


def _run(make, zero, more, backend=None, batches=None, load=None, save=None, compile_after=0) -> dict:
    """Train ``batches`` (compiled with ``backend`` from the start, or after ``compile_after`` steps), optionally
    loading a checkpoint first and saving one at the end; what the tests compare, and dynamo's counts."""
    import zeroshard

    torch._dynamo.reset()
    torch.manual_seed(0)
    engine, *_ = zeroshard.initialize(model=make(), config=_config(zero, more))
    if load is not None:
        engine.load_checkpoint(load)
    losses = []
    for step, (idx, targets) in enumerate(batches or _batches()):
        if backend is not None and step == compile_after:
            engine.compile(backend=backend)
        losses.append(_step(engine, idx, targets))
    if save is not None:
        engine.save_checkpoint(save)
    params = {k: v.clone() for k, v in engine.consolidated_state_dict(rank0_only=False).items()}
    compiled = engine.compiled
    out = {
        "losses": losses,
        "params": params,
        "regions": compiled.paths if compiled else [],
        "graphs": compiled.graphs if compiled else 0,
        "breaks": dict(compiled.breaks) if compiled else {},
        "report": compiled.report() if compiled else "",
        "ledger": {f"{op}/{group}": (t.calls, t.bytes) for (op, group), t in engine.comm_ledger.summary().items()},
    }
    engine.destroy()
    return out


def matrix_worker(directory: str) -> dict:
    out = {}
    for name, (make, zero, more, backend) in CASES.items():
        out[name] = {"eager": _run(make, zero, more), "compiled": _run(make, zero, more, backend)}
    out["interchange"] = interchange_worker(directory)
    out["shapes"] = shapes_worker()
    out["calls"] = calls_worker()
    out["pipeline"] = {kind: pipeline_run(kind == "compiled") for kind in ("eager", "compiled")}
    out["openrlhf"] = {kind: openrlhf_run(kind == "compiled") for kind in ("eager", "compiled")}
    out["sequence_parallel"] = sequence_parallel_runs()  # last: it registers its attention with transformers
    return out


def sequence_parallel_runs() -> dict:
    """Ulysses (sequence parallelism 2, stage 3) on a tiny Llama fed by DeepSpeed's loader adapter, eager and compiled:
    its all-to-all exchanges are graph operators like tensor parallelism's."""
    import zeroshard
    from zeroshard.sequence_parallel import UlyssesSPDataLoaderAdapter, register_with_transformers, token_weighted_loss

    from .test_sequence_parallel import SP_SEQ, _variant_config, sp_model, sp_samples

    ids, labels = sp_samples(1)
    samples = [
        {"input_ids": i, "labels": t, "position_ids": torch.arange(SP_SEQ)[None]} for i, t in zip(ids[0], labels[0])
    ]
    mpu = register_with_transformers(sp_model(), "sdpa", 2, micro_batch_size=1)
    out = {}
    for kind in ("eager", "compiled"):
        torch._dynamo.reset()
        engine, *_ = zeroshard.initialize(model=sp_model(), config=_variant_config(3, "fp32"), mpu=mpu)
        if kind == "compiled":
            engine.compile(backend="aot_eager")
        loader = UlyssesSPDataLoaderAdapter(
            torch.utils.data.DataLoader(samples, batch_size=None), mpu.sequence.rank, mpu.sequence, 2, "cpu"
        )
        losses = []
        for batch in loader:
            shift = batch["shift_labels"]
            output = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=shift,
                            shift_labels=shift)  # fmt: skip
            loss = token_weighted_loss(output.loss, shift, mpu.sequence)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        params = {k: v.clone() for k, v in engine.consolidated_state_dict(rank0_only=False).items()}
        ledger = {f"{op}/{g}": (t.calls, t.bytes) for (op, g), t in engine.comm_ledger.summary().items()}
        out[kind] = {"losses": losses, "params": params, "ledger": ledger}
        if kind == "compiled":
            out[kind].update(graphs=engine.compiled.graphs, breaks=dict(engine.compiled.breaks))
        engine.destroy()
    return out


def openrlhf_run(compiled: bool) -> dict:
    """OpenRLHF's route: its get_train_ds_config (stage 3, bf16, ``--ds.deepcompile``) through ``deepspeed.initialize``,
    then ``engine.compile()`` with no arguments (inductor), as its strategy calls it."""
    import zeroshard

    from ..unit.config.test_client_configs import OPENRLHF

    zeroshard.install_as_deepspeed()
    import deepspeed

    torch._dynamo.reset()
    torch.manual_seed(0)
    config = {**OPENRLHF, "compile": {"deepcompile": True}, "train_micro_batch_size_per_gpu": MICRO,
              "train_batch_size": 2 * MICRO, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}  # fmt: skip
    engine, *_ = deepspeed.initialize(model=_gpt(), config=config)
    if compiled:
        engine.compile()
    losses = [_step(engine, *batch) for batch in _batches(3)]
    out = {"losses": losses, "regions": engine.compiled.paths if compiled else []}
    out["deepcompile"] = (engine.is_deepcompile_enabled(), engine.is_deepcompile_active())
    if compiled:
        out.update(graphs=engine.compiled.graphs, breaks=dict(engine.compiled.breaks))
    engine.destroy()
    return out


def pipeline_run(compiled: bool) -> dict:
    """A two-stage pipeline (ZeRO-1, 2 micro-batches a step): each stage's blocks compiled."""
    import zeroshard
    from zeroshard.pipe import PipelineModule

    from .test_pipeline import config, cross_entropy, global_batches, specs, weights_of

    torch._dynamo.reset()
    module = PipelineModule(specs(), num_stages=2, loss_fn=cross_entropy, seed_layers=True, partition_method="uniform")
    engine, *_ = zeroshard.initialize(model=module, config=config(2, 1))
    if compiled:
        engine.compile(backend="aot_eager")
    losses = [engine.train_batch(iter(batch[:2])).item() for batch in global_batches(1, 2)]
    out = {"losses": losses, "params": weights_of(module)}
    if compiled:
        out.update(regions=engine.compiled.paths, graphs=engine.compiled.graphs, breaks=dict(engine.compiled.breaks))
    engine.destroy()
    return out


def interchange_worker(directory: str) -> dict:
    """Stage 3: a compiled run's checkpoint resumed eagerly (compiling after one more step), and an eager run's
    resumed compiled, each against 5 eager steps."""
    zero, batches = {"stage": 3}, _batches()
    compiled_first = _run(_gpt, zero, {}, "aot_eager", batches[:3], save=f"{directory}/compiled")
    eager_after = _run(_gpt, zero, {}, "aot_eager", batches[3:], load=f"{directory}/compiled", compile_after=1)
    eager_first = _run(_gpt, zero, {}, None, batches[:3], save=f"{directory}/eager")
    compiled_after = _run(_gpt, zero, {}, "aot_eager", batches[3:], load=f"{directory}/eager")
    return {
        "compiled_then_eager": compiled_first["losses"] + eager_after["losses"],
        "compiled_then_eager_params": eager_after["params"],
        "late_compile_regions": eager_after["regions"],
        "eager_then_compiled": eager_first["losses"] + compiled_after["losses"],
        "eager_then_compiled_params": compiled_after["params"],
    }


def shapes_worker() -> dict:
    """Five sequence lengths, then an evaluation forward: dynamo's automatic dynamic shapes mark the length dynamic at
    its first change (one recompile), and no-grad is one more graph."""
    import zeroshard

    torch._dynamo.reset()
    torch.manual_seed(0)
    engine, *_ = zeroshard.initialize(model=_gpt(), config=_config({"stage": 3}, {}))
    engine.compile(backend="aot_eager")
    graphs = []
    for seq in (8, 12, 16, 10, 14):
        _step(engine, *_batches(1, seq)[0])
        graphs.append(engine.compiled.graphs)
    with torch.no_grad():
        engine(*_batches(1, 8)[0])
    graphs.append(engine.compiled.graphs)
    engine.destroy()
    return {"graphs": graphs}


def calls_worker() -> dict:
    """DeepSpeed's spelling (``deepspeed.initialize``, ``engine.compile(backend, compile_kwargs, schedule,
    compiled_autograd_enabled)``), compiling twice, and each hostile call: a named error, nothing compiled."""
    import zeroshard

    zeroshard.install_as_deepspeed()
    import logging

    import deepspeed

    from zeroshard.log import logger

    class Lines(logging.Handler):
        def __init__(self):
            super().__init__(logging.INFO)
            self.lines = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    lines, level = Lines(), logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = _config({"stage": 3}, {"compile": {"deepcompile": True}, "steps_per_print": 2})
    engine, *_ = deepspeed.initialize(model=_gpt(), config=config)
    errors = {}
    for name, call in {
        "unknown_backend": lambda: engine.compile(backend="no_such_backend"),
        "backend_type": lambda: engine.compile(backend=7),
        "unknown_kwarg": lambda: engine.compile(compile_kwargs={"fullgrph": True}),
        "kwargs_type": lambda: engine.compile(compile_kwargs="fullgraph"),
        "schedule": lambda: engine.compile(schedule=[(0, ["z3"])]),
    }.items():
        try:
            call()
        except (ValueError, TypeError, NotImplementedError) as err:
            errors[name] = (type(err).__name__, str(err))
    uncompiled_after_errors = not engine.is_compiled
    engine.compile("aot_eager", {"dynamic": False, "backend": "eager"}, None, compiled_autograd_enabled=True)
    first = engine.compiled
    engine.compile(backend="inductor")  # twice: a no-op
    losses = [_step(engine, *batch) for batch in _batches(2)]
    out = {
        "errors": errors,
        "uncompiled_after_errors": uncompiled_after_errors,
        "same_regions": engine.compiled is first,
        "losses": losses,
        "graphs": engine.compiled.graphs,
        "breaks": dict(engine.compiled.breaks),
        "log": [line for line in lines.lines if "compile" in line],
    }
    engine.destroy()
    logger.removeHandler(lines)
    logger.setLevel(level)
    return out


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    directory = tmp_path_factory.mktemp("compile")
    return run_distributed(matrix_worker, 2, str(directory), timeout_s=900)


def _same(run: dict, eager: dict) -> None:
    assert run["losses"] == pytest.approx(eager["losses"], rel=1e-5, abs=0)
    assert relative_error(run["params"], eager["params"]) <= 1e-5  # the parity bar, per tensor


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_trains_as_eager_with_no_graph_break(compiled, case):
    for rank in compiled:
        eager, run = rank[case]["eager"], rank[case]["compiled"]
        _same(run, eager)
        assert run["regions"] and "" not in run["regions"]
        assert run["ledger"] == eager["ledger"]  # every collective ran and was counted, in the graphs too
        if case == "stage3_expert_parallel":
            # the router reads its token counts back to Python (data-dependent shapes) and exchanges them with a
            # plain collective: dynamo ends the graph at each, named in the log; exact all the same
            assert run["breaks"]
            continue
        assert run["breaks"] == {}, run["breaks"]
        assert 1 <= run["graphs"] <= 2  # each block class compiled once (a second graph: recomputation)
    assert compiled[0][case]["compiled"]["params"].keys() == compiled[1][case]["compiled"]["params"].keys()


def test_regions_are_the_units_or_blocks(compiled):
    regions = {case: compiled[0][case]["compiled"]["regions"] for case in CASES}
    assert regions["stage0"] == regions["stage3"] == ["blocks.0", "blocks.1"]
    assert regions["stage3_embedding_first"] == ["blocks.0", "blocks.1", "blocks.2"]
    assert regions["stage3_checkpointing"] == ["blocks.0", "blocks.1"]  # the Recomputed wrappers (the units)
    assert (
        regions["stage3_tensor_parallel"] == regions["stage3_expert_parallel"] == ["model.layers.0", "model.layers.1"]
    )
    assert "compiled: 2 regions, 1 graphs" in compiled[0]["stage3"]["compiled"]["report"]


def test_checkpoints_are_interchangeable_between_compiled_and_eager_runs(compiled):
    for rank in compiled:
        eager, swap = rank["stage3"]["eager"], rank["interchange"]
        for order in ("compiled_then_eager", "eager_then_compiled"):
            assert swap[order] == pytest.approx(eager["losses"], rel=1e-5, abs=0)
            assert relative_error(swap[f"{order}_params"], eager["params"]) <= 1e-5
        assert swap["late_compile_regions"] == ["blocks.0", "blocks.1"]  # compiled after a step: compiled then


def test_a_changing_sequence_length_recompiles_once(compiled):
    # 8: compiled; 12: recompiled with the length dynamic; 16, 10, 14: no recompile; no_grad: one more graph
    assert compiled[0]["shapes"]["graphs"] == [1, 2, 2, 2, 2, 3]


def test_deepspeed_spelling_twice_and_hostile_calls(compiled):
    calls = compiled[0]["calls"]
    errors = calls["errors"]
    assert errors["unknown_backend"][0] == "ValueError" and "'no_such_backend'" in errors["unknown_backend"][1]
    assert errors["backend_type"][0] == "TypeError"
    assert errors["unknown_kwarg"][0] == "TypeError" and "fullgrph" in errors["unknown_kwarg"][1]
    assert errors["kwargs_type"][0] == "TypeError" and "takes a dict" in errors["kwargs_type"][1]
    assert errors["schedule"][0] == "NotImplementedError" and "schedule" in errors["schedule"][1]
    assert calls["uncompiled_after_errors"] and calls["same_regions"]
    assert calls["breaks"] == {} and calls["graphs"] == 1
    log = "\n".join(calls["log"])  # rank 0's: what was compiled, and the step report's count
    assert "compile.deepcompile: each gather unit is compiled with its gathers" in log
    assert "engine.compile(): 2 x Block (blocks.0 .. blocks.1) compiled in place with aot_eager" in log
    assert "compiled: 2 regions, 1 graphs (1 since the last report), 0 graph breaks" in log
    eager = compiled[0]["stage3"]["eager"]["losses"][:2]
    assert calls["losses"] == pytest.approx(eager, rel=1e-5, abs=0)


def test_a_pipeline_stage_compiles_its_blocks(compiled):
    for rank in compiled:
        eager, run = rank["pipeline"]["eager"], rank["pipeline"]["compiled"]
        _same(run, eager)
        assert run["breaks"] == {} and run["graphs"] == 1
    # the layers a PipelineModule registers itself (not in a ModuleList): each stage's Blocks
    regions = [rank["pipeline"]["compiled"]["regions"] for rank in compiled]
    assert all(regions) and sorted(regions[0] + regions[1], key=int) == ["1", "2", "3", "4", "5", "6"]


def test_openrlhfs_deepcompile_route_trains(compiled):
    for rank in compiled:
        eager, run = rank["openrlhf"]["eager"], rank["openrlhf"]["compiled"]
        assert run["regions"] == ["blocks.0", "blocks.1"] and run["breaks"] == {} and run["graphs"] == 1
        assert eager["deepcompile"] == (True, False) and run["deepcompile"] == (True, True)
        # bf16: inductor rounds inside its fused kernels where eager rounds after each operation
        assert run["losses"] == pytest.approx(eager["losses"], rel=1e-2)


def test_sequence_parallelism_compiles_with_its_exchanges_in_the_graph(compiled):
    for rank in compiled:
        eager, run = rank["sequence_parallel"]["eager"], rank["sequence_parallel"]["compiled"]
        _same(run, eager)
        assert run["ledger"] == eager["ledger"] and run["breaks"] == {} and run["graphs"] <= 2
