"""Engine behaviour beyond plain parity: parameter groups, frozen and unused parameters, client optimizer
and scheduler objects, the data loader, accumulation bookkeeping, Lamb on shards."""

import pytest
import torch

from zeroshard.testing import run_distributed
from zeroshard.testing.parity import make_batches, make_model, model_error

# the references do not clip (DeepSpeed would clip at 1.0 by default)
BASE = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000, "gradient_clipping": 0.0}


def _train(engine, rank, world, steps=3, gas=1):
    for x, y in make_batches(steps, world * 2 * gas):
        for k in range(gas):
            rows = slice((k * world + rank) * 2, (k * world + rank + 1) * 2)
            engine.backward(engine(x[rows], y[rows]))
            engine.step()


def _weights(engine):
    return {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}


def param_groups_worker(stage):
    import zeroshard
    from zeroshard import comm

    model = make_model()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 5e-3}]
    cfg = {**BASE, "zero_optimization": {"stage": stage}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, opt, _, _ = zeroshard.initialize(model=model, model_parameters=groups, config=cfg)
    _train(engine, comm.get_rank(), comm.get_world_size())
    return {"weights": _weights(engine), "lrs": engine.get_lr(), "wds": [g["weight_decay"] for g in opt.param_groups]}


@pytest.mark.parametrize("stage", [0, 2])
def test_param_groups_keep_their_own_lr_and_weight_decay(stage):
    results = run_distributed(param_groups_worker, 2, stage)
    model = make_model()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    ref = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 5e-3}], lr=1e-3
    )
    for x, y in make_batches(3, 4):
        model(x, y).backward()
        ref.step()
        ref.zero_grad()
    assert results[0]["lrs"] == [1e-3, 5e-3] and results[0]["wds"] == [0.1, 0.0]
    assert model_error(results[0]["weights"], model.state_dict()) <= 1e-5


class BranchyModel(torch.nn.Module):
    """A frozen embedding, a branch only rank 0 uses, and a shared trunk."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(16, 8)
        self.embed.weight.requires_grad_(False)
        self.trunk = torch.nn.Linear(8, 8)
        self.rank0_only = torch.nn.Linear(8, 8)

    def forward(self, x, use_branch):
        h = self.trunk(self.embed(x))
        if use_branch:
            h = h + self.rank0_only(h)
        return h.pow(2).mean()


def frozen_unused_worker(stage, overlap):
    import zeroshard
    from zeroshard import comm

    model = BranchyModel()
    frozen_before = model.embed.weight.detach().clone()
    cfg = {
        **BASE,
        "zero_optimization": {"stage": stage, "overlap_comm": overlap, "reduce_bucket_size": 64},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    engine, _, _, _ = zeroshard.initialize(model=model, config=cfg)
    rank = comm.get_rank()
    branch_before = model.rank0_only.weight.detach().clone()
    for step in range(3):
        x = torch.randint(0, 16, (2, 4), generator=torch.Generator().manual_seed(10 * step + rank))
        engine.backward(engine(x, use_branch=(rank == 0)))
        engine.step()
    return {
        "frozen_unchanged": torch.equal(model.embed.weight, frozen_before),
        "branch_moved": not torch.equal(model.rank0_only.weight, branch_before),
        "weights": _weights(engine),
    }


@pytest.mark.parametrize("stage,overlap", [(0, True), (1, False), (2, True)])
def test_frozen_and_rank_dependent_unused_parameters(stage, overlap):
    r0, r1 = run_distributed(frozen_unused_worker, 2, stage, overlap, timeout_s=120)
    assert r0["frozen_unchanged"] and r1["frozen_unchanged"]
    assert r0["branch_moved"] and r1["branch_moved"]  # rank 1 never used it, yet it stays in sync
    for name in r0["weights"]:
        torch.testing.assert_close(r0["weights"][name], r1["weights"][name], rtol=0, atol=0)


def branch_in_first_micro_batch_worker(stage):
    import zeroshard
    from zeroshard import comm

    cfg = {
        **BASE,
        "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 64},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    engine, _, _, _ = zeroshard.initialize(model=BranchyModel(), config=cfg)
    for x in _branch_batches(comm.get_rank()):
        for micro in range(2):
            engine.backward(engine(x[micro], use_branch=micro == 0))
            engine.step()
    return _weights(engine)


def _branch_batches(rank):
    return [
        torch.randint(0, 16, (2, 2, 4), generator=torch.Generator().manual_seed(10 * step + rank)) for step in range(3)
    ]


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_branch_only_an_earlier_micro_batch_took_keeps_its_gradient(stage):
    """Stages 0-1 reduce once, at the last micro-batch: a parameter that backward did not reach then still holds
    the earlier micro-batches' gradient (it was lost: reduced as zero)."""
    results = run_distributed(branch_in_first_micro_batch_worker, 2, stage, timeout_s=120)
    model = BranchyModel()
    reference = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for batches in zip(_branch_batches(0), _branch_batches(1)):
        for x in batches:
            for micro in range(2):
                (model(x[micro], use_branch=micro == 0) / 4).backward()
        reference.step()
        reference.zero_grad()
    for result in results:
        assert model_error(result, model.state_dict()) <= 1e-6


def client_objects_worker():
    import zeroshard
    from zeroshard import comm

    model = make_model()
    client = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(client, lambda step: 1.0 / (step + 1))
    cfg = {**BASE, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 1}}
    engine, opt, _, lr_sched = zeroshard.initialize(model=model, optimizer=client, lr_scheduler=sched, config=cfg)
    seen = []
    rank, world = comm.get_rank(), comm.get_world_size()
    for x, y in make_batches(3, world * 4):
        for k in range(2):
            rows = slice((k * world + rank) * 2, (k * world + rank + 1) * 2)
            engine.backward(engine(x[rows], y[rows]))
            boundary = engine.is_gradient_accumulation_boundary()
            engine.step()
            seen.append((boundary, engine.was_step_applied(), engine.global_steps, engine.global_samples))
    return {
        "seen": seen,
        "lr": engine.get_lr(),
        "same_opt": opt.optimizer is client,
        "same_sched": lr_sched is sched,
        "norm": engine.get_global_grad_norm(),
        "weights": _weights(engine),
        "triad": (
            engine.train_batch_size(),
            engine.train_micro_batch_size_per_gpu(),
            engine.gradient_accumulation_steps(),
            engine.zero_optimization_stage(),
        ),
    }


def adamw_with_lambda_schedule() -> dict:
    """One process: torch's AdamW at lr 1e-2 scaled by 1 / (step + 1), 3 steps of 8 rows."""
    model = make_model()
    ref = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref, lambda step: 1.0 / (step + 1))
    for x, y in make_batches(3, 8):
        model(x, y).backward()
        ref.step()
        ref_sched.step()
        ref.zero_grad()
    return model.state_dict()


def test_client_optimizer_and_scheduler_objects_and_accumulation_bookkeeping():
    r0, _ = run_distributed(client_objects_worker, 2)
    assert r0["same_opt"] and r0["same_sched"]
    assert r0["seen"] == [
        (False, False, 0, 0),
        (True, True, 1, 8),
        (False, False, 1, 8),
        (True, True, 2, 16),
        (False, False, 2, 16),
        (True, True, 3, 24),
    ]
    assert r0["lr"] == [pytest.approx(1e-2 / 4)]  # LambdaLR stepped once per optimizer step
    assert r0["triad"] == (8, 2, 2, 1) and r0["norm"] > 0
    assert model_error(r0["weights"], adamw_with_lambda_schedule()) <= 1e-5


def configure_optimizer_worker():
    """diffusion-pipe's route: an engine built without an optimizer gets one from ``_configure_optimizer`` (a
    callable over the parameters it chose), a torch scheduler set on the engine afterwards; then
    ``communication_data_type`` set to bf16 halves the bytes of the next step's reductions."""
    import zeroshard
    from zeroshard import comm

    model = make_model()
    cfg = {**BASE, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 1}}
    engine, *_ = zeroshard.initialize(model=model, config=cfg)
    before = engine.optimizer
    engine._configure_optimizer(lambda params: torch.optim.AdamW(params, lr=1e-2), list(model.parameters()))
    engine.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda step: 1.0 / (step + 1))
    rank, world = comm.get_rank(), comm.get_world_size()
    _train(engine, rank, world, gas=2)
    weights = _weights(engine)
    refused = {}
    for value in ("int8", torch.int64, float("nan"), None):
        try:
            engine.communication_data_type = value
        except ValueError as error:
            refused[repr(value)] = str(error)
    try:
        engine._configure_optimizer(None, list(model.parameters()))
    except RuntimeError as error:
        refused["again"] = str(error)
    wire = {}
    for dtype in (torch.float32, torch.bfloat16):
        engine.communication_data_type = dtype
        engine.comm_ledger.reset()
        _train(engine, rank, world, steps=1, gas=2)
        wire[str(dtype)] = {op: t.wire_bytes for (op, _), t in engine.comm_ledger.summary().items()}
    dtype = str(engine.communication_data_type)
    return {"before": before, "weights": weights, "refused": refused, "wire": wire, "dtype": dtype}


def test_an_optimizer_configured_after_initialize_trains_as_one_process_and_the_reduction_dtype_follows():
    r0, _ = run_distributed(configure_optimizer_worker, 2)
    assert r0["before"] is None and r0["dtype"] == "torch.bfloat16"
    assert model_error(r0["weights"], adamw_with_lambda_schedule()) <= 1e-5
    assert set(r0["refused"]) == {"'int8'", "torch.int64", "nan", "None", "again"}
    assert "engine.communication_data_type = 'int8'" in r0["refused"]["'int8'"]
    assert "already has an optimizer" in r0["refused"]["again"]
    fp32, bf16 = r0["wire"]["torch.float32"], r0["wire"]["torch.bfloat16"]
    assert bf16["reduce_scatter"] == fp32["reduce_scatter"] / 2, (fp32, bf16)  # the gradients' reduction
    assert bf16["all_gather"] == fp32["all_gather"] > 0  # the updated fp32 weights, as before


def dataloader_worker():
    import zeroshard

    data = torch.utils.data.TensorDataset(torch.arange(40).float().unsqueeze(1))
    model = torch.nn.Linear(1, 1)
    cfg = {"train_batch_size": 8, "gradient_accumulation_steps": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.0}}}
    engine, _, loader, _ = zeroshard.initialize(model=model, training_data=data, config=cfg)
    seen = [int(v) for (batch,) in loader for v in batch.flatten()]
    return {"batch_size": loader.batch_size, "seen": seen, "micro": engine.train_micro_batch_size_per_gpu()}


def test_training_data_gets_a_distributed_sampler():
    r0, r1 = run_distributed(dataloader_worker, 2)
    assert r0["batch_size"] == r1["batch_size"] == r0["micro"] == 2
    assert sorted(r0["seen"] + r1["seen"]) == list(range(40)) and not set(r0["seen"]) & set(r1["seen"])


def lamb_worker(stage):
    import zeroshard
    from zeroshard import comm

    cfg = {**BASE, "zero_optimization": {"stage": stage}, "optimizer": {"type": "Lamb", "params": {"lr": 1e-2}}}
    engine, _, _, _ = zeroshard.initialize(model=make_model(), config=cfg)
    _train(engine, comm.get_rank(), comm.get_world_size())
    return _weights(engine)


def test_lamb_trust_ratios_are_per_parameter_on_shards():
    stage0 = run_distributed(lamb_worker, 2, 0)[0]
    stage2 = run_distributed(lamb_worker, 2, 2)[0]
    for name in stage0:
        torch.testing.assert_close(stage2[name], stage0[name], rtol=1e-5, atol=1e-7)


# gpt-neox ships this block (configs/*.yml); verbose and debug as DeepSpeed documents them
COMMS_LOGGERS = {
    "plain": {"enabled": True},
    "gpt_neox": {"enabled": True, "verbose": True, "prof_all": True, "debug": False},
    "debug": {"enabled": True, "debug": True},
}


def logging_worker():
    import contextlib
    import io

    import zeroshard
    from zeroshard import comm

    runs = {}
    for name, block in COMMS_LOGGERS.items():
        cfg = {
            **BASE,
            "steps_per_print": 1,
            "wall_clock_breakdown": True,
            "comms_logger": block,
            "zero_optimization": {"stage": 2},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        }
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            engine, _, _, _ = zeroshard.initialize(model=make_model(), config=cfg)
            _train(engine, comm.get_rank(), comm.get_world_size(), steps=2)
        calls = [(op, t.calls) for (op, _), t in engine.mesh.context.ledger.totals.items()]
        engine.destroy()
        runs[name] = {"log": out.getvalue(), "calls": calls}
    return {"runs": runs, "summary": comm.log_summary(print_fn=lambda text: None)}


@pytest.fixture(scope="module")
def logged():
    return run_distributed(logging_worker, 2)


def test_step_log_wall_clock_and_comms_logger(logged):
    r0, r1 = logged
    log = r0["runs"]["plain"]["log"]
    assert "config resolved for 2 rank(s), ZeRO stage 2" in log
    assert "step 1: loss" in log and "step 2: loss" in log and "grad_norm" in log and "samples/s" in log
    assert "time (s)" in log and "optimizer_step" in log and "forward" in log
    assert "reduce_scatter" in log and "algbw GB/s" in log
    assert "comm op:" not in log and "issued at" not in log
    assert all(run["log"] == "" for run in r1["runs"].values())  # only rank 0 logs
    assert "all_gather" in r0["summary"] and "shard" in r0["summary"]


def test_comms_logger_verbose_prints_every_collective_and_debug_splits_by_caller(logged):
    r0, _ = logged
    verbose = r0["runs"]["gpt_neox"]
    printed = [line.split("] ", 1)[1] for line in verbose["log"].splitlines() if "] comm op: " in line]
    timed = sum(n for op, n in verbose["calls"] if op in ("reduce_scatter", "all_gather", "all_reduce"))
    assert len(printed) == timed > 0  # one line per collective, as it completed
    assert any(line.startswith("comm op: reduce_scatter on 'shard' | time (ms): ") for line in printed)
    assert all("| msg size: " in line and "| busbw (GB/s): " in line for line in printed)
    debug = r0["runs"]["debug"]["log"]
    assert "comm op:" not in debug
    callers = [line for line in debug.splitlines() if "issued at " in line]
    assert callers and any("zeroshard/zero/" in line for line in callers)  # the mechanism that issued it


def non_finite_worker(stage, dtype):
    """One parameter's gradient is NaN on every step (as a bad batch or an overflowing layer makes it)."""
    import zeroshard
    from zeroshard.testing.parity import ParityCase, make_batches, make_model
    from zeroshard.zero import NonFiniteGradientError

    config = ParityCase(stage=stage, dtype=dtype, extra=(("max_consecutive_skipped_steps", 3),)).config()
    engine, *_ = zeroshard.initialize(model=make_model(), config=config)
    poisoned = engine.module.blocks[1].fc.weight
    poisoned.register_hook(lambda grad: grad * float("nan"))
    try:
        for x, y in make_batches(6, 2):
            engine.backward(engine(x, y))
            engine.step()
    except NonFiniteGradientError as err:
        return str(err), engine.skipped_steps
    return None, engine.skipped_steps


@pytest.mark.parametrize("stage,dtype", [(0, "fp32"), (2, "bf16"), (3, "fp32")])
def test_non_finite_gradients_stop_training_after_the_configured_skipped_steps(stage, dtype):
    for message, skipped in run_distributed(non_finite_worker, 2, stage, dtype):
        assert skipped == 2 and message is not None, (skipped, message)
        assert message.startswith("optimizer step 3: gradients were non-finite for 3 steps in a row"), message
        assert "first at parameter 'blocks.1.fc.weight'" in message, message


def honoured_keys_worker(directory):
    """DeepSpeed keys zeroshard honours, each with and without the setting."""
    import warnings

    import zeroshard
    from zeroshard import comm
    from zeroshard.ops.adam import CPUAdam
    from zeroshard.testing.parity import ParityCase, make_batches, make_model

    out = {}
    rank = comm.get_rank()

    def with_unused(ignore):
        model = make_model()
        model.spare = torch.nn.Linear(4, 4)  # never used in forward
        config = ParityCase(stage=2, zero=(("ignore_unused_parameters", ignore),)).config()
        engine, *_ = zeroshard.initialize(model=model, config=config)
        x, y = make_batches(1, 2)[0]
        engine.backward(engine(x, y))
        engine.step()

    with_unused(True)
    try:
        with_unused(False)
    except RuntimeError as err:
        out["unused"] = str(err)

    offload = (("offload_optimizer", {"device": "cpu"}),)
    for force, make in ((True, torch.optim.AdamW), (False, torch.optim.AdamW), (True, CPUAdam)):
        model = make_model()
        config = ParityCase(stage=2, zero=offload, extra=(("zero_force_ds_cpu_optimizer", force),)).config()
        del config["optimizer"]
        try:
            zeroshard.initialize(model=model, optimizer=make(model.parameters(), lr=1e-3), config=config)
            out[(force, make.__name__)] = "ok"
        except ValueError as err:
            out[(force, make.__name__)] = str(err)

    for validation in ("Fail", "Warn"):
        config = ParityCase(stage=2, extra=(("checkpoint", {"tag_validation": validation}),)).config()
        engine, *_ = zeroshard.initialize(model=make_model(), config=config)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                out[validation] = engine.save_checkpoint(directory, tag=f"tag-of-rank{rank}")
            except ValueError as err:
                out[validation] = str(err)
        out[validation + "-warnings"] = [str(w.message) for w in caught]
    return out


def test_deepspeed_keys_that_zeroshard_honours(tmp_path):
    for r in run_distributed(honoured_keys_worker, 2, str(tmp_path)):
        assert "received no gradient in this backward ['spare.bias', 'spare.weight']" in r["unused"], r["unused"]
        assert "offload_optimizer with a client optimizer (AdamW)" in r[(True, "AdamW")]
        assert r[(False, "AdamW")] == "ok" and r[(True, "CPUAdam")] == "ok"
        assert "the ranks pass different tags (rank 0: 'tag-of-rank0', rank 1: 'tag-of-rank1')" in r["Fail"]
        assert r["Warn"] == str(tmp_path / "tag-of-rank0")
        assert any("saved as rank 0's tag 'tag-of-rank0'" in w for w in r["Warn-warnings"])


def two_engines_worker():
    """Two identical stage-3 engines in one process, trained in turns: each must behave as if alone."""
    import zeroshard
    from zeroshard import comm
    from zeroshard.zero import GatheredParameters

    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}  # every parameter sharded
    cfg = {**BASE, "zero_optimization": zero, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    first, *_ = zeroshard.initialize(model=make_model(), config=cfg)
    _train(first, comm.get_rank(), comm.get_world_size(), steps=1)
    after_one_step = first.comm_ledger.summary()
    second, *_ = zeroshard.initialize(model=make_model(), config=cfg)  # must not reset the first engine's counts
    kept = first.comm_ledger.summary() == after_one_step
    _train(second, comm.get_rank(), comm.get_world_size(), steps=1)
    untouched = first.comm_ledger.summary() == after_one_step
    for engine in (first, second):
        _train(engine, comm.get_rank(), comm.get_world_size(), steps=2)
    ledgers = [e.comm_ledger.summary() for e in (first, second)]
    engine_bytes = [e.comm_ledger.total_wire_bytes() for e in (first, second)]
    process_bytes = comm.LEDGER.total_wire_bytes()
    weight = next(first.module.parameters())
    other = next(second.module.parameters())
    with GatheredParameters([weight]):  # gathers the first engine's unit only
        other_status = other.ds_status.name
    return {
        **_two_checkpointing_blocks(cfg),
        "kept_after_second_initialize": kept,
        "untouched_by_second_engine": untouched,
        "ledgers": ledgers,
        "engine_bytes": engine_bytes,
        "process_bytes": process_bytes,
        "records_separate": type(weight)._records is first.records and type(other)._records is second.records,
        "other_status_while_gathered": other_status,
        "weights": [
            {k: v.float() for k, v in e.consolidated_state_dict(rank0_only=False).items()} for e in (first, second)
        ],
    }


def _two_checkpointing_blocks(cfg: dict) -> dict:
    """Two engines whose configs differ in their activation_checkpointing blocks: each forward runs under its own
    engine's options (``profile`` logs each checkpointed segment), and initialize configured nothing process-wide."""
    import contextlib
    import io

    import zeroshard
    from zeroshard.runtime import activation_checkpointing
    from zeroshard.testing.models import recompute_blocks

    activation_checkpointing.reset()
    engines = {
        profile: zeroshard.initialize(
            model=recompute_blocks(make_model()),
            config={**cfg, "activation_checkpointing": {"profile": profile, "synchronize_checkpoint_boundary": True}},
        )[0]
        for profile in (True, False)
    }
    x, y = make_batches(1, 2)[0]
    logs = {}
    for profile in (True, False, True):  # in turns: the second engine does not reconfigure the first
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            engines[profile].backward(engines[profile](x, y))
        logs.setdefault(profile, []).append(out.getvalue().count("activation checkpoint "))
    return {
        "checkpoint_lines": logs,
        "options": {
            p: (e.activation_checkpointing.profile, e.activation_checkpointing.synchronize) for p, e in engines.items()
        },
        "configured_after": activation_checkpointing.is_configured(),
    }


def test_two_engines_in_one_process_keep_their_counts_and_parameters_apart():
    result = run_distributed(two_engines_worker, 2)[0]
    # activation checkpointing: profile lines (one per block, forward and recomputation) from the first engine only
    assert result["options"] == {True: (True, True), False: (False, True)}
    assert result["checkpoint_lines"][False] == [0] and result["checkpoint_lines"][True] == [4, 4]
    assert result["configured_after"] is False
    assert result["kept_after_second_initialize"] and result["untouched_by_second_engine"]
    first, second = result["ledgers"]
    assert first == second and result["engine_bytes"][0] > 0  # the same work, counted per engine
    assert result["process_bytes"] >= sum(result["engine_bytes"])  # the process counts both (and the broadcasts)
    assert result["records_separate"] and result["other_status_while_gathered"] == "NOT_AVAILABLE"
    for name, value in result["weights"][0].items():
        assert torch.equal(value, result["weights"][1][name]), name
    model = make_model()
    ref = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)  # "AdamW" by name: DeepSpeed's default
    for x, y in make_batches(1, 4) + make_batches(2, 4):  # the engines' batches: one step, then two
        model(x, y).backward()
        ref.step()
        ref.zero_grad()
    assert model_error(result["weights"][0], model.state_dict()) <= 1e-5
