"""``GatheredParameters(params, modifier_rank=0)`` on every mesh: each rank keeps the value of the rank holding its
piece at the modifier's coordinate (never another rank's piece), replicated parameters take the modifier's own, and
the master weights follow, so training continues as one process would after the same edit.

One spawn of 4 ranks runs every layout (TP=2 x DP=2, EP=2 x DP=2, hybrid sharding 2 x 2, TP=2 x SP=2) at stages
0-3, once with nothing modified inside the context and once with an edit: the modifier (rank 0) and its counterpart
in the other tensor / expert position (rank 1, for its pieces only) apply ``edit``, every other rank writes
``garbage``, which must be discarded."""

import pytest
import torch

from zeroshard.testing import run_distributed

WORLD, MICRO, SEQ, LR = 4, 2, 8, 1e-2
STAGES = (0, 1, 2, 3)
LAYOUTS = ("tp", "ep", "hybrid", "tp_sp")
TRAINED = ("tp", "ep", "hybrid")  # the Ulysses layout is checked on its values and masters only


def edit(value: torch.Tensor) -> torch.Tensor:
    return value * 0.5 + 0.25


def garbage(value: torch.Tensor) -> torch.Tensor:
    return value + 100.0


def _model(layout: str):
    from zeroshard.testing.hf import tiny_causal_lm

    return tiny_causal_lm("mixtral" if layout == "ep" else "llama")


def _config(layout: str, stage: int) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    if layout in ("tp", "tp_sp"):
        config["tensor_parallel"] = {"autotp_size": 2}
    if layout == "ep":
        config["expert_parallel"] = {"enabled": True, "autoep_size": 2, "preset_model": "mixtral"}
    if layout == "hybrid":
        config["zero_optimization"]["zero_hpz_partition_size"] = 2
    if layout == "tp_sp":
        config["train_micro_batch_size_per_gpu"] = 1
    return config


def _batches(data_ranks: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 64, (data_ranks * MICRO, SEQ), generator=g) for _ in range(2)]


def reference(layout: str, modified: bool) -> dict:
    """One process: a step on the global batch (the mean of the data ranks' losses), the edit, another step."""
    model = _model(layout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    data_ranks = 2 if layout == "tp" else WORLD
    for step, batch in enumerate(_batches(data_ranks)):
        if step == 1 and modified:
            with torch.no_grad():
                for param in model.parameters():
                    param.copy_(edit(param))
        loss = sum(model(input_ids=part, labels=part).loss for part in batch.chunk(data_ranks)) / data_ranks
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _local_values(engine) -> dict[str, torch.Tensor]:
    from zeroshard.zero import GatheredParameters

    with GatheredParameters(list(engine.module.parameters())):
        return {name: p.detach().clone() for name, p in engine.module.named_parameters()}


class _BlockError(RuntimeError):
    """Raised inside the context after the writes (a load that failed half-way), and caught around it."""


def _run(layout: str, stage: int, modified: bool, mpu=None, raises: str = "") -> dict:
    """This rank's pieces before and after the context, its master weights after, and (``TRAINED`` layouts) the
    whole model after one more step. ``raises``: after writing, every rank (``"every"``) or only the modifier
    (``"modifier"``) raises inside the context, and the script catches it: the modifier's values are kept all the
    same (DeepSpeed broadcasts whatever happened), so every rank still holds one model."""
    import zeroshard
    from zeroshard.zero import GatheredParameters

    rank = zeroshard.comm.get_rank()
    engine, *_ = zeroshard.initialize(model=_model(layout), config=_config(layout, stage), mpu=mpu)
    trained = layout in TRAINED
    batches = _batches(engine.mesh.batch.size)
    if trained:
        part = batches[0].chunk(engine.mesh.batch.size)[engine.mesh.batch.rank]
        engine.backward(engine(input_ids=part, labels=part).loss)
        engine.step()
    before = _local_values(engine)
    pieces = set(engine.tensor_splits)
    try:
        with GatheredParameters(list(engine.module.parameters()), modifier_rank=0):
            if modified:
                with torch.no_grad():
                    for name, param in engine.module.named_parameters():
                        keeps = rank == 0 or (rank == 1 and name in pieces)
                        param.copy_(edit(param) if keeps else garbage(param))
            if raises == "every" or (raises == "modifier" and rank == 0):
                raise _BlockError("the load failed after the writes")
    except _BlockError:
        pass
    out = {
        "before": before,
        "after": _local_values(engine),
        "master": {n: engine.param_access.full_fp32_param(p).clone() for n, p in engine.module.named_parameters()},
        "pieces": pieces,
    }
    if trained:
        part = batches[1].chunk(engine.mesh.batch.size)[engine.mesh.batch.rank]
        engine.backward(engine(input_ids=part, labels=part).loss)
        engine.step()
        out["state"] = engine.consolidated_state_dict(rank0_only=True)
    engine.destroy()
    return out


def gathered_worker() -> dict:
    from zeroshard.sequence_parallel import register_with_transformers

    out = {}
    for layout in LAYOUTS:
        mpu = None
        if layout == "tp_sp":  # replaces the process's attention: last
            mpu = register_with_transformers(_model(layout), "sdpa", 2, micro_batch_size=1, tensor_parallel_size=2)
        for stage in STAGES:
            for modified in (False, True):
                out[(layout, stage, modified)] = _run(layout, stage, modified, mpu)
            for case in RAISING:
                if case[:2] == (layout, stage):
                    out[case] = _run(layout, stage, True, mpu, raises=case[3])
    out["disagree"] = _modifier_disagreement()
    return out


def _modifier_disagreement() -> str:
    """Each rank names itself as the modifier: a named error on every rank, not a wait in four broadcasts."""
    import zeroshard
    from zeroshard.zero import GatheredParameters

    try:
        with GatheredParameters([torch.nn.Parameter(torch.ones(2))], modifier_rank=zeroshard.comm.get_rank()):
            pass
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.fixture(scope="module")
def gathered_runs() -> list:
    return run_distributed(gathered_worker, WORLD, timeout_s=900)


CASES = [(layout, stage, modified) for layout in LAYOUTS for stage in STAGES for modified in (False, True)]
# (layout, stage, modified, who raises inside the context)
RAISING = [
    ("tp", 1, True, "every"),
    ("tp", 3, True, "every"),
    ("ep", 1, True, "every"),
    ("hybrid", 1, True, "every"),
    ("tp", 1, True, "modifier"),
    ("hybrid", 3, True, "modifier"),
]


@pytest.mark.parametrize("case", CASES + RAISING, ids=["-".join(map(str, c)) for c in CASES + RAISING])
def test_each_rank_keeps_the_modifier_counterparts_piece(gathered_runs, case):
    """After the context every rank holds, for a piece, the (edited) value its counterpart of rank 0 held (rank
    r % 2 in every layout here: the rank with the same tensor / expert position among rank 0's data ranks), and for a
    replicated parameter rank 0's; the master weights hold the same values."""
    modified = case[2]
    for rank, run in enumerate(gathered_runs):
        got = run[case]
        for name, value in got["after"].items():
            source = rank % 2 if name in got["pieces"] else 0
            held = gathered_runs[source][case]["before"][name]
            expected = edit(held) if modified else got["before"][name]
            assert torch.equal(value, expected), (rank, name)
            assert torch.equal(got["master"][name], expected), (rank, name)


@pytest.mark.parametrize("case", [c for c in CASES + RAISING if c[0] in TRAINED], ids=lambda c: "-".join(map(str, c)))
def test_training_after_the_context_matches_one_process(gathered_runs, case):
    """A step, the context (the edit applied in one process too), a step: the whole model within 1e-5."""
    from zeroshard.testing.parity import model_error

    layout, modified = case[0], case[2]
    assert model_error(gathered_runs[0][case]["state"], reference(layout, modified)) < 1e-5


def test_tensor_parallel_layouts_hold_different_pieces(gathered_runs):
    """The check above is not vacuous: the two tensor-parallel positions hold different values of each piece."""
    for case in CASES:
        first, second = gathered_runs[0][case], gathered_runs[1][case]
        assert first["pieces"] or case[0] == "hybrid"
        for name in first["pieces"]:
            assert not torch.equal(first["before"][name], second["before"][name]), (case, name)


def test_ranks_naming_different_modifiers_get_a_named_error(gathered_runs):
    for run in gathered_runs:
        assert run["disagree"].startswith(
            "GatheredParameters: the ranks pass different modifier_rank (rank 0: 0, rank 1: 1, rank 2: 2, rank 3: 3)"
        ), run["disagree"]
