"""ZeRO stage 3: parity, memory (16P/N), traffic (3P less the root's second gather), prefetch budget,
GatheredParameters, the sharded-access error, save_16bit_model, hybrid sharding, injected delays.

Tolerances as for stages 0-2: fp32 whole-model relative error <= 1e-5 (per tensor <= 1e-4), bf16 <= 1e-2.
"""

import math
import os
import statistics
import time

import pytest
import torch

from zeroshard.accelerator import host_peak_rss
from zeroshard.testing import WorkerError, run_distributed
from zeroshard.testing.hf import tiny_causal_lm
from zeroshard.testing.models import GPTConfig
from zeroshard.testing.parity import (
    ParityCase,
    engine_train_many,
    make_batches,
    make_model,
    model_error,
    reference_train,
    relative_error,
)

BLOCK_UNITS = (("gather_unit_classes", ["Block"]), ("stage3_param_persistence_threshold", 0), ("overlap_comm", True))
ODD = GPTConfig(vocab_size=61, block_size=16, n_layer=2, n_head=2, n_embd=30, repeat_first_block=True)

CASES = [ParityCase(stage=3, gas=g, dtype=d, lr=1e-3, zero=BLOCK_UNITS) for g in (1, 2) for d in ("fp32", "bf16")]
CASES += [
    # odd sizes that do not divide the world size, a block run twice per forward, frozen parameters
    ParityCase(stage=3, gas=2, lr=1e-3, zero=BLOCK_UNITS, model=ODD, frozen=("wpe.weight", "blocks.1.fc.bias")),
    # size-based units and persistent small parameters (LayerNorms, biases stay gathered)
    ParityCase(
        stage=3, gas=1, lr=1e-3, zero=(("gather_unit_min_params", 5000), ("stage3_param_persistence_threshold", 200))
    ),
    ParityCase(stage=3, gas=2, optimizer="SGD", lr=0.5, clip=0.05, zero=BLOCK_UNITS),
    ParityCase(stage=3, gas=2, lr=1e-3, zero=BLOCK_UNITS, comm_delay_s=0.003),  # races provoked
]
IDS = [
    "fp32-gas1",
    "bf16-gas1",
    "fp32-gas2",
    "bf16-gas2",
    "odd-twice-frozen",
    "size-units-persistent",
    "sgd-clip",
    "injected-delays",
]


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def run(request):
    return request.param, run_distributed(engine_train_many, request.param, CASES)


@pytest.mark.parametrize("index", range(len(CASES)), ids=IDS)
def test_parity_with_single_process(run, index):
    world, per_rank = run
    case = CASES[index]
    got = per_rank[0][index]
    expected = reference_train(case, world)
    if case.dtype == "fp32":
        assert model_error(got["params"], expected) <= 1e-5
        assert relative_error(got["params"], expected) <= 1e-4
    else:
        assert model_error(got["params"], expected) <= 1e-2
    for other in per_rank[1:]:
        for name, tensor in got["params"].items():
            torch.testing.assert_close(other[index]["params"][name], tensor, rtol=0, atol=0)


def test_sharded_model_state_is_16_bytes_per_parameter_over_n(run):
    world, per_rank = run
    got = per_rank[0][1]  # bf16, Adam
    shards = sum(numel // world for numel, _ in got["flat_numels"])
    b = got["state_bytes"]
    assert b["params"] == 2 * shards and b["master"] == 4 * shards and b["grad_shard"] == 2 * shards
    assert b["optimizer_state"] == 8 * shards and b["gathered"] == 0
    total = b["params"] + b["master"] + b["grad_shard"] + b["optimizer_state"]
    p = got["num_params"]
    assert 16 * p / world <= total <= 16 * (p / world + len(got["flat_numels"]))


def units_from_shapes(case: ParityCase, world: int, engine_units: dict) -> tuple[int, list[int], int]:
    """(root unit, other units, persistent group) in elements moved, padded to the world, from the model's parameter
    shapes: parameters under ``stage3_param_persistence_threshold`` elements stay gathered in one resident group;
    with Block units each block is a unit and the rest is the root. Size-based units (``gather_unit_min_params``)
    are the engine's grouping: only their boundaries are read from it."""
    model = make_model(model=case.model)

    def padded(n: int) -> int:
        return -(-n // world) * world

    threshold = dict(case.zero)["stage3_param_persistence_threshold"]
    persistent = {id(p) for p in model.parameters() if p.numel() < threshold}
    if "gather_unit_classes" not in dict(case.zero):
        sizes = {name: padded(n) for name, n in engine_units.items()}
        return (
            sizes.pop("<root>"),
            list(sizes.values()),
            padded(sum(p.numel() for p in model.parameters() if id(p) in persistent)),
        )
    blocks = [sum(p.numel() for p in block.parameters() if id(p) not in persistent) for block in model.blocks]
    rest = sum(p.numel() for p in model.parameters() if id(p) not in persistent) - sum(blocks)
    resident = sum(p.numel() for p in model.parameters() if id(p) in persistent)
    return padded(rest), [padded(n) for n in blocks], padded(resident) if resident else 0


@pytest.mark.parametrize("index", [0, 1, 2, 5], ids=["fp32-gas1", "bf16-gas1", "fp32-gas2", "persistent"])
def test_bytes_per_step_match_analytic(run, index):
    """Per micro-batch: every non-root unit gathered twice (forward, backward), the root once (it stays gathered
    from forward to the end of backward), and from the second micro-batch on (once the unit order is recorded) the
    last unit of forward once (it stays gathered into its backward: reuse distance 0); every flat group
    reduce-scattered once; per step: resident (persistent) groups all-gathered after the step, plus the 4-byte
    gradient-norm all-reduce. The sizes come from the model's shapes (``units_from_shapes``), not from the engine's
    plan."""
    world, per_rank = run
    case, got = CASES[index], per_rank[0][index]
    elem = 4 if case.dtype == "fp32" else 2
    ring = (world - 1) / world
    root, units, resident = units_from_shapes(case, world, dict(got["units"]))
    micro_batches = case.steps * case.gas
    gathers = micro_batches * (2 * sum(units) + root) - (micro_batches - 1) * units[-1] + case.steps * resident
    reduces = micro_batches * (root + sum(units) + resident)
    analytic = (gathers + reduces) * elem * ring + case.steps * 2 * ring * 4
    assert got["wire_bytes"] == pytest.approx(analytic, rel=1e-12)
    p = got["num_params"]
    if case.gas == 1 and not resident:
        # the ZeRO paper's 3P, less one gather of the root unit and (after the first step) of the last block
        kept = units[-1] * (case.steps - 1) / case.steps
        assert got["wire_bytes"] / case.steps == pytest.approx((3 * p - root - kept) * elem * ring, rel=2e-2)


BUDGETS = [(0, 10**9, 1), (13000, 10**9, 1), (10**9, 10**9, 1), (10**9, 10**9, 10**6), (10**9, 45000, 10**6)]


def budget_worker():
    """Peak gathered elements for each (stage3_prefetch_bucket_size, stage3_max_live_parameters, stage3_prefetch_depth),
    one engine after another in one spawn."""
    from zeroshard.testing.parity import engine_train

    peaks = {}
    for prefetch, max_live, depth in BUDGETS:
        budgets = (
            ("stage3_prefetch_bucket_size", prefetch),
            ("stage3_max_live_parameters", max_live),
            ("stage3_prefetch_depth", depth),
        )
        case = ParityCase(
            stage=3,
            lr=1e-3,
            steps=2,
            model=GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32),
            zero=BLOCK_UNITS + budgets,
        )
        result = engine_train(case)
        peaks[(prefetch, max_live, depth)], units = result["peak_gathered_numel"], dict(result["units"])
    return peaks, units


def test_prefetch_depth_and_budgets_bound_peak_gathered_parameters():
    peaks, units = run_distributed(budget_worker, 2)[0]
    root, block = units["<root>"], units["blocks.0"]
    assert peaks[(0, 10**9, 1)] == root + block  # no prefetch: the root and one block at a time
    assert peaks[(13000, 10**9, 1)] == root + 2 * block  # one block ahead
    assert peaks[(10**9, 10**9, 1)] == root + 2 * block  # the default depth: one unit ahead, whatever the budget
    assert peaks[(10**9, 10**9, 10**6)] > root + 2 * block  # no depth limit: the element budget decides
    assert peaks[(10**9, 45000, 10**6)] <= 45000 < peaks[(10**9, 10**9, 10**6)]  # the live budget caps it


def gathered_worker():
    import zeroshard
    from zeroshard import comm
    from zeroshard.zero import GatheredParameters, ShardedParameterError

    model = make_model()
    cfg = ParityCase(stage=3, zero=BLOCK_UNITS + (("stage3_gather_16bit_weights_on_model_save", True),)).config()
    engine, _, _, _ = zeroshard.initialize(model=model, config=cfg)
    weight = model.blocks[0].fc.weight
    try:
        weight.sum()
        error = None
    except ShardedParameterError as err:
        error = str(err)
    shape_ok = weight.shape == (128, 32) and weight.numel() == 128 * 32
    with GatheredParameters([weight], modifier_rank=0):
        if comm.get_rank() == 0:
            weight.data.fill_(0.5)
    kept = engine.consolidated_state_dict(rank0_only=False)["blocks.0.fc.weight"]
    with GatheredParameters(weight):
        weight.data.fill_(-1.0)  # no modifier_rank: discarded
    discarded = engine.consolidated_state_dict(rank0_only=False)["blocks.0.fc.weight"]
    x, y = make_batches(1, 2 * comm.get_world_size())[0]
    r = comm.get_rank()
    engine.backward(engine(x[2 * r : 2 * r + 2], y[2 * r : 2 * r + 2]))
    engine.step()
    return {
        "error": error,
        "shape_ok": shape_ok,
        "kept": kept,
        "discarded": discarded,
        "peak_after_step": engine.stage3.live_numel,
    }


def test_gathered_parameters_and_sharded_access_error():
    for result in run_distributed(gathered_worker, 2):
        assert "parameter 'blocks.0.fc.weight' (128, 32) is sharded by ZeRO stage 3" in result["error"]
        assert "zeroshard.zero.GatheredParameters" in result["error"]
        assert result["shape_ok"]
        assert torch.all(result["kept"] == 0.5) and torch.all(result["discarded"] == 0.5)
        assert result["peak_after_step"] == 0  # nothing stays gathered between steps


def save_worker(tmp: str, gather_flag: bool):
    import zeroshard

    model = make_model()
    cfg = ParityCase(
        stage=3, dtype="bf16", zero=BLOCK_UNITS + (("stage3_gather_16bit_weights_on_model_save", gather_flag),)
    ).config()
    engine, _, _, _ = zeroshard.initialize(model=model, config=cfg)
    saved = engine.save_16bit_model(tmp, "model.bin")
    return saved, engine.consolidated_state_dict(rank0_only=False)


def test_save_16bit_model(tmp_path):
    (saved, full), _ = run_distributed(save_worker, 2, str(tmp_path), True)
    assert saved
    on_disk = torch.load(tmp_path / "model.bin")
    assert set(on_disk) == set(full) and all(torch.equal(on_disk[k], full[k]) for k in full)
    assert on_disk["blocks.0.fc.weight"].dtype == torch.bfloat16
    # the tied head is stored as the embedding itself (one storage), not as an equal copy
    assert on_disk["lm_head.weight"].untyped_storage().data_ptr() == on_disk["wte.weight"].untyped_storage().data_ptr()
    (saved, _), _ = run_distributed(save_worker, 2, str(tmp_path / "no"), False)
    assert not saved and not (tmp_path / "no").exists()


HYBRID = [ParityCase(stage=3, gas=g, shard_size=2, lr=1e-3, zero=BLOCK_UNITS) for g in (1, 2)]


def test_hybrid_stage3_two_replicas_of_two_way_shards():
    per_rank = run_distributed(engine_train_many, 4, HYBRID)
    for index, case in enumerate(HYBRID):
        got = per_rank[0][index]
        assert model_error(got["params"], reference_train(case, 4)) <= 1e-5
        shards = sum(n // 2 for n, _ in got["flat_numels"])
        assert got["state_bytes"]["master"] == 0 and got["state_bytes"]["params"] == 4 * shards  # fp32: 1/2 each
        assert math.isclose(shards, got["num_params"] / 2, rel_tol=0.01)
        assert "all_reduce/replica" in got["ledger"] and "all_gather/shard" in got["ledger"]


def test_unsupported_rank_divergence_is_reported_not_hung():
    """A stage-3 model whose ranks run different modules fails with a named collective error."""
    with pytest.raises(WorkerError, match=r"rank \d: \w+ on group 'shard' \(ranks \[0, 1\]\)"):
        run_distributed(divergent_worker, 2, comm_timeout_s=5, timeout_s=90)


def divergent_worker():
    import zeroshard
    from zeroshard import comm

    model = make_model()
    engine, _, _, _ = zeroshard.initialize(model=model, config=ParityCase(stage=3, zero=BLOCK_UNITS).config())
    if comm.get_rank() == 1:
        model.blocks = torch.nn.ModuleList([model.blocks[0]])  # rank 1 skips block 1: its gathers never happen
    x, y = make_batches(1, 4)[0]
    engine.backward(engine(x[:2], y[:2]))
    engine.step()


INIT_CASES = [
    ParityCase(stage=3, gas=g, dtype=d, lr=1e-3, zero=BLOCK_UNITS, zero_init=True, frozen=("wpe.weight",))
    for g, d in ((1, "fp32"), (2, "bf16"))
]


def test_training_from_a_zero_init_model_matches_the_reference():
    per_rank = run_distributed(engine_train_many, 2, INIT_CASES)
    for index, case in enumerate(INIT_CASES):
        expected = reference_train(case, 2)
        tolerance = 1e-5 if case.dtype == "fp32" else 1e-2
        assert model_error(per_rank[0][index]["params"], expected) <= tolerance


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def build_big_model(use_init: bool):
    import zeroshard
    from zeroshard.testing.models import GPT

    cfg = GPTConfig(vocab_size=4096, block_size=64, n_layer=8, n_head=8, n_embd=1024)
    before_peak, before_now = host_peak_rss(), rss_bytes()
    torch.manual_seed(0)
    with zeroshard.zero.Init(enabled=use_init):
        model = GPT(cfg)
    peak = host_peak_rss() - before_peak
    held = rss_bytes() - before_now
    return max(peak, held), sum(p.numel() for p in model.parameters()) * 4


def test_zero_init_builds_a_model_larger_than_what_it_allocates():
    ((peak_init, full_bytes),) = run_distributed(build_big_model, 1, True)
    ((peak_plain, _),) = run_distributed(build_big_model, 1, False)
    assert full_bytes > 400e6
    # measured: plain ~1.05x the parameter bytes, Init ~0.19x (a few of the largest parameters, allocator slack)
    assert peak_plain > 0.9 * full_bytes, (peak_plain, full_bytes)  # a normal build holds every parameter
    assert peak_init < 0.35 * full_bytes, (peak_init, full_bytes)  # under Init: about one parameter at a time


def test_zero_init_refuses_a_non_stage3_config():
    import zeroshard

    with pytest.raises(
        ValueError, match="zero.Init builds stage-3 models, but the config has zero_optimization.stage 2"
    ):
        zeroshard.zero.Init(config_dict_or_path={"zero_optimization": {"stage": 2}})


def unit_argument_worker():
    import zeroshard
    from zeroshard.testing.models import Block

    cfg = ParityCase(stage=3, zero=(("stage3_param_persistence_threshold", 0),)).config()
    engine, _, _, _ = zeroshard.initialize(model=make_model(), config=cfg, gather_unit_classes=[Block])
    return [u.name for u in engine.stage3.units]


def test_gather_unit_classes_python_argument():
    assert run_distributed(unit_argument_worker, 2)[0] == ["blocks.0", "blocks.1"]


class Checkpointed(torch.nn.Module):
    """Recomputes the wrapped block in backward (non-reentrant activation checkpointing): the block's
    forward hooks run again inside backward."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


def checkpointed_worker():
    """The same training with and without recomputation (lr 1e-3, as the other stage-3 parity cases)."""
    import zeroshard
    from zeroshard import comm
    from zeroshard.testing.models import Block
    from zeroshard.testing.parity import engine_train

    case = ParityCase(stage=3, steps=2, lr=1e-3, zero=BLOCK_UNITS)
    model = make_model()
    model.blocks = torch.nn.ModuleList(Checkpointed(block) for block in model.blocks)
    engine, _, _, _ = zeroshard.initialize(model=model, config=case.config(), gather_unit_classes=[Block])
    rank = comm.get_rank()
    for x, y in make_batches(2, 4):
        engine.backward(engine(x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]))
        engine.step()
    checkpointed = {k.replace(".block.", "."): v for k, v in engine.consolidated_state_dict(rank0_only=False).items()}
    return checkpointed, engine_train(case)["params"]


def test_activation_checkpointing_recomputes_inside_gathered_units():
    """Recomputation is exact: bitwise the run without checkpointing. (This test once compared with the reference
    at lr 1e-2 and failed on some machines with 1.07e-05 > 1e-5: the runs were bitwise reproducible, and the
    plain stage-3 run had the same error, i.e. no timing-dependent order: per-rank means averaged vs one
    full-batch mean round differently, and Adam at lr 1e-2 amplifies that rounding on near-zero gradients.)"""
    checkpointed, plain = run_distributed(checkpointed_worker, 2)[0]
    for name, tensor in plain.items():
        assert torch.equal(checkpointed[name].float(), tensor), name
    expected = reference_train(ParityCase(stage=3, steps=2, lr=1e-3), 2)
    assert model_error({k: v.float() for k, v in checkpointed.items()}, expected) <= 1e-5


def pretrained_worker(path: str, stage: int) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel

    import zeroshard

    config = GPT2Config.from_pretrained(path)
    with zeroshard.zero.Init():
        model = GPT2LMHeadModel(config)
    ds = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = zeroshard.initialize(model=model, config=ds, pretrained=path)
    return engine.consolidated_state_dict(rank0_only=False)


@pytest.mark.parametrize("stage", [2, 3])
def test_pretrained_weights_fill_a_zero_init_model_exactly(tmp_path, stage):
    from safetensors.torch import load_file
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=16, bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(config).save_pretrained(tmp_path)
    expected = load_file(tmp_path / "model.safetensors")
    for state in run_distributed(pretrained_worker, 2, str(tmp_path), stage):
        assert all(torch.equal(state[name], value) for name, value in expected.items())
        assert torch.equal(state["lm_head.weight"], expected["transformer.wte.weight"])  # the tied head


def test_pretrained_weights_missing_a_parameter_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=96, n_positions=16, bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(config).save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["transformer.h.0.mlp.c_fc.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(
        WorkerError, match=r"lacks 1 parameter\(s\) of the model: \['transformer.h.0.mlp.c_fc.weight'\]"
    ):
        run_distributed(pretrained_worker, 2, str(tmp_path), 3)


class _WithStatistics(torch.nn.Module):
    """A persistent buffer pair (BatchNorm's running statistics) beside parameters."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.norm = torch.nn.BatchNorm1d(4)


def pretrained_refusals_worker(directory: str) -> dict:
    import zeroshard
    from zeroshard.checkpoint import CheckpointError

    ds = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    out = {}
    for name in ("good.safetensors", "no-running-mean.safetensors", "wrong-running-var.safetensors", "evil.pt"):
        with zeroshard.zero.Init():
            model = _WithStatistics()
        try:
            engine, *_ = zeroshard.initialize(
                model=model, config={**ds, "zero_optimization": {"stage": 3}}, pretrained=os.path.join(directory, name)
            )
            out[name] = {k: v.clone() for k, v in engine.module.norm.named_buffers()}
        except (ValueError, CheckpointError) as err:
            out[name] = str(err)
    return out


def test_pretrained_buffers_are_required_and_checked_and_pickles_never_run(tmp_path):
    """Persistent buffers are weights: missing ones were skipped silently, a wrong shape raised a bare RuntimeError.
    A pickle handed to pretrained= is refused as a corrupted file, and nothing in it runs."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    state = _WithStatistics().state_dict()
    state["norm.running_mean"] = torch.arange(4.0)
    save_file(state, tmp_path / "good.safetensors")
    save_file({k: v for k, v in state.items() if k != "norm.running_mean"}, tmp_path / "no-running-mean.safetensors")
    save_file({**state, "norm.running_var": torch.ones(5)}, tmp_path / "wrong-running-var.safetensors")
    marker = tmp_path / "PWNED"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    torch.save({"linear.weight": Payload()}, tmp_path / "evil.pt")
    for out in run_distributed(pretrained_refusals_worker, 2, str(tmp_path)):
        assert torch.equal(out["good.safetensors"]["running_mean"], torch.arange(4.0))
        assert "lacks 1 buffer(s) of the model: ['norm.running_mean']" in out["no-running-mean.safetensors"]
        assert "'norm.running_var': pretrained (5,), the model (4,)" in out["wrong-running-var.safetensors"]
        assert "evil.pt is truncated or corrupted" in out["evil.pt"], out["evil.pt"]
    assert not marker.exists()


def moe_worker() -> dict:
    """A tiny HF Mixtral, 4 experts, top-1 routing, 3 tokens per rank: each rank leaves some experts without a
    token. Stage 3 with the default units, with ``zero_optimization.leaf_module``, and with DeepSpeed's
    ``set_z3_leaf_modules`` (compat), against stage 0."""
    import zeroshard

    zeroshard.install_as_deepspeed()
    import deepspeed
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    from zeroshard import comm

    rank = comm.get_rank()
    ids = torch.randint(0, 64, (4, 3), generator=torch.Generator().manual_seed(1))
    runs = {}
    for name, stage, leaf, mark in (
        ("stage0", 0, None, False),
        ("default", 3, None, False),
        ("config", 3, {"classes": ["MixtralSparseMoeBlock"]}, False),
        ("marked", 3, None, True),
        ("container", 3, {"names": ["model.layers"]}, False),  # a ModuleList: gathered when a layer in it runs
        ("granular", 3, 300, False),  # stage3_module_granularity_threshold: the attention blocks as leaves
        ("coarse", 3, 10**7, False),  # ... the whole model, one unit
    ):
        model = tiny_causal_lm("mixtral")
        if mark:
            deepspeed.utils.set_z3_leaf_modules(model, [MixtralSparseMoeBlock])
        zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
        if isinstance(leaf, dict):
            zero["leaf_module"] = leaf
        elif leaf:
            zero["stage3_module_granularity_threshold"] = leaf
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": zero,
            "steps_per_print": float("inf"),
        }
        engine, *_ = deepspeed.initialize(model=model, config=config)
        losses = []
        for _ in range(2):
            mine = ids[2 * rank : 2 * rank + 2]
            loss = engine(input_ids=mine, labels=mine).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        units = [u.name for u in engine.stage3.units] if engine.stage3 is not None else []
        if stage == 3 and name == "default":  # the idle buffers go, and the next step gets new ones
            idle = engine.stack.buffers.idle_bytes
            engine.empty_partition_cache()
            mine = ids[2 * rank : 2 * rank + 2]
            runs["cache"] = (idle, engine.stack.buffers.idle_bytes, engine(input_ids=mine, labels=mine).loss.item())
        flagged = sorted(n for n, m in model.named_modules() if deepspeed.utils.z3_leaf_module(m))
        runs[name] = {
            "losses": losses,
            "weights": engine.consolidated_state_dict(rank0_only=False),
            "units": units,
            "flagged": flagged,
        }
        engine.destroy()
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    config["zero_optimization"] = {"stage": 3}
    for careless in ({"leaf_modules": [torch.nn.Linear(2, 2)]}, {"leaf_modules": ["model.nowhere"]}):
        try:  # a module of another model, a path that is not there: named, before anything is sharded
            zeroshard.initialize(model=tiny_causal_lm("mixtral"), config=config, **careless)
        except ValueError as err:
            runs.setdefault("refused", []).append(str(err))
    return runs


def test_moe_with_idle_experts_matches_stage_0_with_default_units_and_leaf_modules():
    runs = run_distributed(moe_worker, 2, timeout_s=300)[0]
    reference = runs["stage0"]
    for name in ("default", "config", "marked", "container", "granular", "coarse"):
        assert runs[name]["losses"] == pytest.approx(reference["losses"], rel=1e-5), name
        assert model_error(runs[name]["weights"], reference["weights"]) <= 1e-5, name
    assert "model.layers.0" in runs["default"]["units"]  # the decoder layers, by default
    idle_before, idle_after, loss = runs["cache"]
    assert idle_before > 0 and idle_after == 0 and math.isfinite(loss)  # engine.empty_partition_cache()
    assert runs["refused"] == [
        "leaf module Linear is not a module of the model being initialized",
        "leaf modules ['model.nowhere'] match no module of MixtralForCausalLM",
    ]
    for name in ("config", "marked"):  # each MoE block is a unit of its own, nothing chosen inside it
        assert {"model.layers.0.mlp", "model.layers.1.mlp"} <= set(runs[name]["units"])
        assert not any(u.startswith("model.layers.0.mlp.") for u in runs[name]["units"])
    # DeepSpeed's leaf_module may name a container, and its granularity threshold chooses leaves; both are flagged
    # on the modules as DeepSpeed flags them (z3_leaf_module)
    assert runs["container"]["units"] == ["model.layers"] and runs["container"]["flagged"] == ["model.layers"]
    attention = ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert set(attention) <= set(runs["granular"]["units"]) and runs["granular"]["flagged"] == attention
    assert runs["coarse"]["units"] == [] and runs["coarse"]["flagged"] == [""]  # the root unit holds everything


class Pause(torch.autograd.Function):
    """Compute that takes ``seconds`` in forward and again in backward on any machine (a sleep), so a gather issued
    before it is hidden behind it whatever the machine's speed."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class Layer(torch.nn.Module):
    def __init__(self, n_in: int, n_out: int, seconds: float):
        super().__init__()
        self.linear, self.seconds = torch.nn.Linear(n_in, n_out), seconds

    def forward(self, x):
        return Pause.apply(self.linear(x), self.seconds) if self.seconds else self.linear(x)


WIDTHS = (12, 20, 28, 36, 12)  # every layer's flat group a different size: a gather's shape names its unit


def schedule_worker(runs: list[tuple[dict, float, float]]) -> list[dict]:
    """One engine per run (zero-config overrides, compute seconds per layer and direction, extra seconds every
    all-gather takes from its issue): per step, the all-gathers and reduce-scatters in issue order (as unit names)
    and the exposed all-gather wait; the slowed waits' unhidden seconds; the final weights."""
    import zeroshard
    from zeroshard import comm
    from zeroshard.testing import slow_collectives

    results = []
    for overrides, seconds, slow in runs:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(Layer(a, b, seconds) for a, b in zip(WIDTHS, WIDTHS[1:])))
        zero = {"stage": 3, "gather_unit_classes": ["Layer"], "stage3_param_persistence_threshold": 0, **overrides}
        config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
        engine, *_ = zeroshard.initialize(model=model, config={**config, "zero_optimization": zero})
        names = {a * b + b: f"layers.{i}" for i, (a, b) in enumerate(zip(WIDTHS, WIDTHS[1:]))}  # even: unpadded
        link = slow_collectives(slow)
        trace, steps = comm.DEFAULT_CONTEXT.trace, []
        gen = torch.Generator().manual_seed(comm.get_rank())
        for _ in range(4):
            x = torch.randn(4, WIDTHS[0], generator=gen)
            start, waited = trace.seq, engine.exposed_wait().get("all_gather", 0.0)
            engine.backward(engine(x).pow(2).mean())
            engine.step()
            ops = [(e.op, names.get(math.prod(e.shape))) for e in trace.entries if e.seq > start]
            steps.append(
                {
                    "ops": [o for o in ops if o[0] in ("all_gather", "reduce_scatter")],
                    "gather_wait": engine.exposed_wait().get("all_gather", 0.0) - waited,
                }
            )
        slow_collectives(0)
        params = engine.consolidated_state_dict(rank0_only=False)
        results.append({"steps": steps, "unhidden": link.unhidden, "params": params})
        engine.destroy()
    return results


def test_gathers_follow_the_recorded_unit_order_and_the_last_unit_stays_gathered_into_backward():
    """The schedule the first forward records decides every later step: forward gathers each unit once, the next
    one issued before the current one runs; backward keeps the last unit of forward (reuse distance 0), gathers the
    others in reverse order, each issued before the reduce-scatter of the unit after it (the gradient work it
    overlaps). ``stage3_max_reuse_distance`` 1e9 (DeepSpeed's default) keeps every unit: no gather in backward.
    Keeping changes when parameters are gathered, never the arithmetic: the weights are bitwise equal."""
    runs = [({}, 0.0, 0.0), ({"stage3_max_reuse_distance": 10**9}, 0.0, 0.0), ({"stage3_prefetch_depth": 0}, 0.0, 0.0)]
    default, keep_all, no_prefetch = run_distributed(schedule_worker, 2, runs)[0]
    forward = [("all_gather", f"layers.{i}") for i in range(4)]
    steady = default["steps"][1]["ops"]
    assert steady == [
        *forward,
        ("all_gather", "layers.2"),  # prefetched at layers.3's backward, before its gradients are reduced
        ("reduce_scatter", "layers.3"),
        ("all_gather", "layers.1"),
        ("reduce_scatter", "layers.2"),
        ("all_gather", "layers.0"),
        ("reduce_scatter", "layers.1"),
        ("reduce_scatter", "layers.0"),
    ], steady
    assert all(step["ops"] == steady for step in default["steps"][1:])
    # before any order is recorded, the last unit is freed after forward and gathered again
    assert default["steps"][0]["ops"][4] == ("all_gather", "layers.3")
    assert keep_all["steps"][1]["ops"] == [*forward] + [("reduce_scatter", f"layers.{i}") for i in (3, 2, 1, 0)]
    assert [o for o in no_prefetch["steps"][1]["ops"] if o[0] == "all_gather"] == [
        o for o in steady if o[0] == "all_gather"
    ]
    for other in (keep_all, no_prefetch):
        for name, tensor in default["params"].items():
            assert torch.equal(other["params"][name], tensor), name


def test_hybrid_sharding_follows_the_same_schedule():
    """Two replicas of two-way shards (4 ranks, ``zero_hpz_partition_size`` 2): the same gathers and reduce-scatters
    in the same order as on one shard group, on each replica's shard group; every rank ends with the same weights."""
    per_rank = run_distributed(schedule_worker, 4, [({"zero_hpz_partition_size": 2}, 0.0, 0.0)])
    backward = [("all_gather", "layers.2"), ("all_gather", "layers.1"), ("all_gather", "layers.0")]
    for (hybrid,) in per_rank:
        ops = hybrid["steps"][1]["ops"]
        assert [o for o in ops if o[0] == "all_gather"] == [("all_gather", f"layers.{i}") for i in range(4)] + backward
        assert [o for o in ops if o[0] == "reduce_scatter"] == [("reduce_scatter", f"layers.{i}") for i in (3, 2, 1, 0)]
        for name, tensor in per_rank[0][0]["params"].items():
            assert torch.equal(hybrid["params"][name], tensor), name


def test_a_slower_gather_is_hidden_behind_the_compute_it_was_prefetched_for():
    """Every all-gather made to take 50 ms from its issue (far more than 10x its time here), each layer computing
    100 ms in forward and in backward: with the prefetch the only gather no compute can hide is the first unit's
    in forward (nothing runs before it), so the seam sleeps for one gather a step and the exposed all-gather wait
    grows by about that much; without prefetch every gather of the step (7) is waited for in full."""
    slow, compute = 0.05, 0.1
    runs = [({}, compute, 0.0), ({}, compute, slow), ({"stage3_prefetch_depth": 0}, compute, slow)]
    fast, prefetched, waited = run_distributed(schedule_worker, 2, runs)[0]
    per_step = 7  # 4 in forward, 3 in backward (the last unit stays gathered)
    assert len(prefetched["unhidden"]) == len(waited["unhidden"]) == 8 + 3 * per_step  # the first step gathers 8
    hidden = [s for _, s in prefetched["unhidden"] if s == 0.0]
    assert len(hidden) >= 3 * (per_step - 1), prefetched["unhidden"]  # all but the first unit's, from step 2 on
    base, with_prefetch, without = (
        statistics.median(step["gather_wait"] for step in run["steps"][1:]) for run in (fast, prefetched, waited)
    )
    assert without >= per_step * slow  # each gather waited for: its 50 ms from the issue, issue included
    unhidden = sum(s for _, s in prefetched["unhidden"][8:]) / 3  # per step, after the first
    assert unhidden <= 1.1 * slow  # the first unit's gather
    # the wait grows by what could not be hidden; the margin is for ranks drifting apart on a loaded machine
    assert with_prefetch - base <= unhidden + 3 * slow, (base, with_prefetch, unhidden)
