"""Pipelines under hostile and careless input, on 4 Gloo ranks (PP2 x DP2 unless said): every exception in
``train_batch`` / ``eval_batch`` ends every rank with a named error while the processes stay alive (each case catches
it and the spawn goes on, as a test harness or a notebook does), never a hang; a frozen stage, a failure after the
stages agreed, a checkpoint one stage cannot load, ranks with different batch settings, tied layers that differ, an
announcement too large, a rogue stop word, the end of the data at a batch boundary.

One spawn runs every case; the data order check compares with torch's own ``DistributedSampler``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.distributed.test_pipeline import Embed, config, cross_entropy, global_batches, logits, specs
from zeroshard.testing import run_distributed


def _error(call) -> str:
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the error is the result
        return f"{type(error).__name__}: {error}"
    return "no error"


def _pipeline(layer_specs=None, gas: int = 4, stages: int = 2, partition: str = "parameters", **extra):
    import zeroshard
    from zeroshard.pipe import PipelineModule

    module = PipelineModule(
        layer_specs or specs(), num_stages=stages, loss_fn=cross_entropy, seed_layers=True, partition_method=partition
    )
    engine, *_ = zeroshard.initialize(model=module, config=config(gas, 1, **extra))
    return engine


def _batch(engine, gas: int = 4) -> list:
    return global_batches(engine.grid.get_data_parallel_world_size(), gas)[0][:gas]


class Explodes(nn.Module):
    """A layer raising in forward (``when="forward"``) at a given call, or in backward at a given micro-batch (an
    out-of-memory in the last backward, after the stages agreed)."""

    def __init__(self, rank: int, when: str, at: int):
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.rank, self.when, self.at, self.calls = rank, when, at, 0

    def forward(self, x):
        from zeroshard import comm

        self.calls += 1
        mine = comm.get_rank() == self.rank and self.calls == self.at
        if mine and self.when == "forward":
            raise ValueError(f"layer failed at forward {self.at}")
        if mine and self.when == "backward":
            x = _RaiseInBackward.apply(x)
        return self.linear(x)


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("CUDA out of memory (simulated) in the last micro-batch's backward")


def exploding_specs(rank: int, when: str, at: int) -> list:
    from zeroshard.pipe import LayerSpec

    layer_specs = specs(blocks=4)
    layer_specs.insert(1, LayerSpec(Explodes, rank, when, at))  # on stage 0 of PP2
    return layer_specs


def _failing_iterator(batches, at: int):
    for index, batch in enumerate(batches):
        if index == at:
            raise OSError("the data loader's file went away")
        yield batch


def _run_case(kind: str, ckpt_dir: str):
    """One case on every rank; returns what the rank saw (an error's 'Type: message', or a dict)."""
    from zeroshard import comm

    rank = comm.get_rank()
    if kind in ("iterator_one_rank", "iterator_whole_stage"):
        engine = _pipeline()
        fails = rank == 0 if kind == "iterator_one_rank" else engine.stage_id == 0
        data = _batch(engine)
        first = _error(lambda: engine.train_batch(_failing_iterator(data, 1) if fails else iter(data)))
        return {"first": first, "again": _error(lambda: engine.train_batch(iter(data)))}
    if kind == "collate":
        from torch.utils.data import Dataset

        class Ragged(Dataset):  # sample 4 is longer: the micro-batch holding it cannot be stacked
            def __len__(self):
                return 16

            def __getitem__(self, index):
                length = 7 if index == 4 else 6
                ids = torch.arange(index, index + length + 1) % 32
                return ids[:-1], ids[1:]

        import zeroshard
        from zeroshard.pipe import PipelineModule

        module = PipelineModule(specs(), num_stages=2, loss_fn=cross_entropy, seed_layers=True)
        engine, *_ = zeroshard.initialize(model=module, config=config(4, 1), training_data=Ragged())
        return {"first": _error(engine.train_batch)}
    if kind == "layer":
        engine = _pipeline(exploding_specs(rank=1, when="forward", at=3))  # stage 0 of the second pipeline
        return {"first": _error(lambda: engine.train_batch(iter(_batch(engine))))}
    if kind == "after_agreement":
        engine = _pipeline(exploding_specs(rank=0, when="backward", at=4))  # the last micro-batch's backward
        first = _error(lambda: engine.train_batch(iter(_batch(engine))))
        return {"first": first, "save": _error(lambda: engine.save_checkpoint(ckpt_dir, tag="after_failure"))}
    if kind == "gas_differs":
        return {"first": _error(lambda: _pipeline(gas=2 if rank == 3 else 4))}
    if kind in ("tie_transposed", "tie_sizes", "tie_attr"):
        from zeroshard.pipe import TiedLayerSpec

        layer_specs = specs()
        if kind == "tie_attr":
            layer_specs[-1] = TiedLayerSpec("embed", Embed, forward_fn=logits, tied_weight_attr="nonexistent")
            layer_specs[0] = TiedLayerSpec("embed", Embed, tied_weight_attr="nonexistent")
        else:
            shape = (16, 32) if kind == "tie_transposed" else (40, 16)  # Embed(vocab, dim): (32, 16) on stage 0
            layer_specs[-1] = TiedLayerSpec("embed", Embed, *shape, forward_fn=logits)
        return {"first": _error(lambda: _pipeline(layer_specs))}
    if kind == "small_activation_limit":
        engine = _pipeline(pipeline={"max_activation_bytes": 100})
        return {"first": _error(lambda: engine.train_batch(iter(_batch(engine))))}
    if kind == "rogue_word":
        from zeroshard.pipe.exchange import ACTIVATIONS

        engine = _pipeline()
        if rank == 0:  # a stop word naming no rank of this 4-rank world, where stage 1 reads its first word
            comm.post_send(torch.tensor([-20]), 2, engine.exchange.pipe, tag=ACTIVATIONS)
        return {"first": _error(lambda: engine.train_batch(iter(_batch(engine))))}
    if kind == "epoch_end":
        engine = _pipeline()
        data = _batch(engine)
        first = engine.train_batch(iter(data)).item()
        epoch = iter(data)
        engine.train_batch(epoch)  # consumes the epoch
        ended = _error(lambda: engine.train_batch(epoch))
        stops = False
        try:
            engine.train_batch(iter([]))
        except StopIteration:
            stops = True
        return {"first": first, "ended": ended, "stops": stops, "next_epoch": engine.train_batch(iter(data)).item()}
    if kind == "eval_count":
        engine = _pipeline()
        return {"first": _error(lambda: engine.eval_batch(iter(_batch(engine)), num_micro_batches=10**6))}
    raise AssertionError(kind)


def frozen_stage_case(frozen_layers: int) -> dict:
    """PP2 x DP2 with the first ``frozen_layers`` layers (every one of stage 0's) frozen: trains as one process."""
    import zeroshard
    from zeroshard.pipe import PipelineModule

    module = PipelineModule(
        specs(tied=False), num_stages=2, loss_fn=cross_entropy, seed_layers=True, partition_method="type:Block"
    )
    for name, param in module.named_parameters():
        param.requires_grad_(int(name.split(".")[0]) >= frozen_layers)
    engine, *_ = zeroshard.initialize(model=module, config=config(4, 1))
    batches = global_batches(engine.grid.get_data_parallel_world_size(), 4)
    dp = engine.grid.get_data_parallel_rank()
    losses = [engine.train_batch(iter(step[dp * 4 : (dp + 1) * 4])).item() for step in batches]
    return {"losses": losses, "parts": module.parts, "trainable": sum(p.requires_grad for p in module.parameters())}


def frozen_reference(frozen_layers: int) -> list[float]:
    from zeroshard.pipe import PipelineModule

    from .test_pipeline import CLIP, LR

    model = PipelineModule(specs(tied=False), num_stages=1, seed_layers=True, loss_fn=cross_entropy)
    for name, param in model.named_parameters():
        param.requires_grad_(int(name.split(".")[0]) >= frozen_layers)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    losses = []
    for step in global_batches(2, 4):
        optimizer.zero_grad()
        total = sum(cross_entropy(model(x), y) for x, y in step) / len(step)
        total.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], CLIP)
        optimizer.step()
        losses.append(total.item())
    return losses


def checkpoint_one_stage_case(ckpt_dir: str) -> dict:
    """A checkpoint saved at PP2 x DP2, loaded into a model with one more block on stage 1 only: every rank raises
    named, a start-fresh handler goes on, and the next batch runs."""
    from zeroshard.checkpoint import CheckpointError
    from zeroshard.pipe import LayerSpec

    saved = _pipeline(partition="type:Block")  # 3 blocks a stage: stage 0 holds layers 0-3 in both models
    saved.train_batch(iter(_batch(saved)))
    saved.save_checkpoint(ckpt_dir, tag="pp2")
    saved.destroy()
    layer_specs = [*specs(), LayerSpec(nn.Linear, 32, 32)]  # stage 1 alone holds a layer the checkpoint lacks
    engine = _pipeline(layer_specs, partition="type:Block")
    try:
        engine.load_checkpoint(ckpt_dir, tag="pp2")
        refused = "no error"
    except CheckpointError as error:  # the clients' start-fresh handler
        refused = f"{type(error).__name__}: {error}"
    loss = engine.train_batch(iter(_batch(engine))).item()
    return {"refused": refused, "loss": loss, "stage": engine.stage_id}


def data_order_case() -> dict:
    """initialize(training_data=): a pipeline reads its share in order (DeepSpeed's pipeline engine), the plain
    engine and deepspeed_io(route='train') shuffled, deepspeed_io(route='eval') in order."""
    import zeroshard
    from zeroshard.pipe import PipelineModule

    class Indices(torch.utils.data.Dataset):
        def __len__(self):
            return 16

        def __getitem__(self, index):
            return torch.tensor([index]), torch.tensor([index])

    module = PipelineModule(specs(), num_stages=2, loss_fn=cross_entropy, seed_layers=True)
    engine, *_ = zeroshard.initialize(model=module, config=config(4, 1), training_data=Indices())
    pipeline = [next(engine.data_iterator)[0].flatten().tolist() for _ in range(4)] if engine.data_iterator else None
    plain, *_ = zeroshard.initialize(
        model=nn.Linear(1, 1), config=config(4, 1), training_data=Indices(), collate_fn=None
    )
    shuffled = [batch[0].flatten().tolist() for batch in plain.training_dataloader][:4]
    train = [b[0].flatten().tolist() for b in plain.deepspeed_io(Indices())][:4]
    evaluation = [b[0].flatten().tolist() for b in plain.deepspeed_io(Indices(), route="eval")][:4]
    errors = [
        _error(lambda: plain.deepspeed_io([1, 2, 3])),
        _error(lambda: plain.deepspeed_io(Indices(), route="test")),
        _error(lambda: plain.deepspeed_io(Indices(), batch_size=0)),
    ]
    grid = engine.grid
    return {
        "pipeline": pipeline,
        "pipeline_dp": (grid.get_data_parallel_rank(), grid.get_data_parallel_world_size()),
        "shuffled": shuffled,
        "train": train,
        "eval": evaluation,
        "errors": errors,
        "dp": (plain.mesh.batch.rank, plain.mesh.batch.size),
    }


CASES = (
    "iterator_one_rank",
    "iterator_whole_stage",
    "collate",
    "layer",
    "after_agreement",
    "gas_differs",
    "tie_transposed",
    "tie_sizes",
    "tie_attr",
    "small_activation_limit",
    "rogue_word",
    "epoch_end",
    "eval_count",
)


def _four_ranks(ckpt_dir: str) -> dict:
    out = {kind: _run_case(kind, ckpt_dir) for kind in CASES}
    out["frozen"] = frozen_stage_case(frozen_layers=4)
    out["checkpoint_one_stage"] = checkpoint_one_stage_case(ckpt_dir)
    out["data_order"] = data_order_case()
    return out


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return run_distributed(_four_ranks, 4, str(tmp_path_factory.mktemp("pipeline_failures")), timeout_s=600)


def _starts(results: list, kind: str, key: str, expected: list[str]) -> None:
    for rank, (result, start) in enumerate(zip(results, expected)):
        assert result[kind][key].startswith(start), (rank, result[kind][key])


REFUSED_AGAIN = "PipelineError: rank {rank}: train_batch() after a failed batch of this engine"


@pytest.mark.parametrize(
    "kind, expected",
    [
        (
            "iterator_one_rank",
            ["OSError: the data loader's file went away"]
            + ["StageAborted: rank 1 (pipeline stage 0): stopped "]  # by its stage, or by its own pipeline first
            + ["StageAborted: rank 2 (pipeline stage 1): stopped waiting for activations from rank 0: rank 0 failed"]
            + ["StageAborted: rank 3 (pipeline stage 1): stopped "],
        ),
        (
            "iterator_whole_stage",
            ["OSError: the data loader's file went away"] * 2
            + ["StageAborted: rank 2 (pipeline stage 1): stopped waiting for activations from rank 0: rank 0 failed"]
            + ["StageAborted: rank 3 (pipeline stage 1): stopped waiting for activations from rank 1: rank 1 failed"],
        ),
    ],
)
def test_a_data_iterator_raising_ends_every_rank_named_and_the_engine_refuses_the_next_batch(four, kind, expected):
    _starts(four, kind, "first", expected)
    aborted = [r[kind]["first"] for r in four if r[kind]["first"].startswith("StageAborted")]
    assert aborted and all("rank 0" in m or "rank 1" in m for m in aborted)  # each names a rank that failed
    for rank, result in enumerate(four):
        assert result[kind]["again"].startswith(REFUSED_AGAIN.format(rank=rank)), result[kind]["again"]


def test_a_collate_failure_ends_every_rank_named(four):
    """DeepSpeed's TestPipeDynamicShape's fault: a micro-batch whose samples cannot be stacked."""
    for rank, result in enumerate(four):
        message = result["collate"]["first"]
        assert message.startswith(("RuntimeError: stack expects each tensor", "StageAborted: rank")), (rank, message)
    assert any(r["collate"]["first"].startswith("RuntimeError: stack expects each tensor") for r in four)


def test_a_layer_raising_ends_every_rank_named(four):
    _starts(four, "layer", "first", ["StageAborted: rank 0", "ValueError: layer failed at forward 3"])
    _starts(four, "layer", "first", ["StageAborted", "ValueError", "StageAborted: rank 2", "StageAborted: rank 3"])


def test_a_failure_after_the_stages_agreed_reaches_every_rank_and_save_is_refused(four):
    expected = ["RuntimeError: CUDA out of memory (simulated)"] + [
        f"StageAborted: rank {r} (pipeline stage {r // 2}): stopped at the end of the batch: rank 0 (pipeline stage 0)"
        for r in (1, 2, 3)
    ]
    _starts(four, "after_agreement", "first", expected)
    for rank, result in enumerate(four):
        assert result["after_agreement"]["save"].startswith(
            f"PipelineError: rank {rank}: save_checkpoint() after a failed batch of this engine"
        ), result["after_agreement"]["save"]


def test_ranks_with_different_batch_settings_are_named_at_initialize(four):
    for result in four:
        assert result["gas_differs"]["first"].startswith(
            "BatchMismatchError: the ranks resolved different gradient_accumulation_steps (2 on rank(s) [3]; 4 on "
            "rank(s) [0, 1, 2])"
        ), result["gas_differs"]["first"]


@pytest.mark.parametrize(
    "kind, layouts",
    [
        ("tie_transposed", "stage 0 builds [(32, 16) float32], stage 1 builds [(16, 32) float32]"),
        ("tie_sizes", "stage 0 builds [(32, 16) float32], stage 1 builds [(40, 16) float32]"),
    ],
)
def test_tied_layers_that_differ_between_stages_are_named_on_every_rank(four, kind, layouts):
    for result in four:
        assert result[kind]["first"] == (
            f"ValueError: tied layer 'embed': the stages holding it build different parameters ({layouts}); the "
            "TiedLayerSpecs of one key must build the same module on every stage"
        )


def test_a_tied_weight_attr_the_module_lacks_is_named_on_every_rank(four):
    for result in four:
        assert result["tie_attr"]["first"].startswith(
            "ValueError: tied layer 'embed': tied_weight_attr ['nonexistent'] names no attribute of its Embed"
        ), result["tie_attr"]["first"]


def test_an_announcement_above_the_limit_names_the_sender_before_allocating(four):
    for rank in (2, 3):
        assert four[rank]["small_activation_limit"]["first"].startswith(
            f"PipelineError: rank {rank}: stage 0 (rank {rank - 2}) announced activations of 768 bytes"
        ), four[rank]["small_activation_limit"]["first"]
    for rank in (0, 1):
        assert four[rank]["small_activation_limit"]["first"].startswith("StageAborted: rank"), four[rank]


def test_a_rogue_stop_word_is_named(four):
    assert four[2]["rogue_word"]["first"].startswith(
        "PipelineError: rank 2 (pipeline stage 1): rank 0 sent the stop word -20, which names no rank of this 4-rank "
        "world"
    ), four[2]["rogue_word"]["first"]
    assert all(r["rogue_word"]["first"].startswith(("StageAborted", "PipelineError")) for r in four)


def test_the_end_of_the_data_at_a_batch_boundary_stops_every_rank_and_the_next_epoch_runs(four):
    for rank, result in enumerate(four):
        case = result["epoch_end"]
        assert case["ended"].startswith("PipelineDataExhausted: rank"), (rank, case["ended"])
        assert case["stops"] is True  # a StopIteration everywhere
        assert case["next_epoch"] == pytest.approx(four[0]["epoch_end"]["next_epoch"])
    assert four[0]["epoch_end"]["ended"].startswith("PipelineDataExhausted: rank 0 (pipeline stage 0): the data")


def test_eval_batch_names_the_micro_batch_count_it_was_asked_for(four):
    assert four[0]["eval_count"]["first"].startswith(
        "PipelineDataExhausted: rank 0 (pipeline stage 0): the data iterator ended at micro-batch 4 of 1000000"
    ), four[0]["eval_count"]["first"]


def test_a_frozen_stage_joins_the_step_and_trains_as_one_process(four):
    expected = frozen_reference(4)
    for result in four:
        assert result["frozen"]["parts"][1] == 4  # stage 0 holds layers 0-3, all frozen
        assert max(abs(a - b) for a, b in zip(result["frozen"]["losses"], expected)) <= 1e-5
    assert four[0]["frozen"]["trainable"] == 0 and four[2]["frozen"]["trainable"] > 0


def test_a_checkpoint_one_stage_cannot_load_is_refused_on_every_rank(four):
    for result in four:
        assert result["checkpoint_one_stage"]["refused"].startswith("CheckpointError"), result["checkpoint_one_stage"]
        assert result["checkpoint_one_stage"]["loss"] > 0  # the start-fresh run's batch ran on every rank
    assert (
        "loading" in four[0]["checkpoint_one_stage"]["refused"] or "rank" in four[0]["checkpoint_one_stage"]["refused"]
    )


def test_training_data_is_read_in_order_by_pipelines_and_shuffled_otherwise(four):
    from torch.utils.data.distributed import DistributedSampler

    for result in four:
        order = result["data_order"]
        dp, size = order["pipeline_dp"]
        in_order = list(DistributedSampler(range(16), num_replicas=size, rank=dp, shuffle=False))
        if order["pipeline"] is not None:  # the first and last stages read it
            assert order["pipeline"] == [in_order[i : i + 2] for i in range(0, 8, 2)]
        dp, size = order["dp"]
        shuffled = list(DistributedSampler(range(16), num_replicas=size, rank=dp, shuffle=True))
        plain = list(DistributedSampler(range(16), num_replicas=size, rank=dp, shuffle=False))
        assert (
            order["shuffled"] == order["train"] == [shuffled[i : i + 2] for i in range(0, 8, 2)][: len(order["train"])]
        )
        assert order["eval"] == [plain[i : i + 2] for i in range(0, 8, 2)][: len(order["eval"])]
        assert order["errors"][0].startswith("ValueError: deepspeed_io: training data must be a torch Dataset")
        assert "route='test'" in order["errors"][1] and "batch_size=0" in order["errors"][2]


def _slow(batches, seconds: float):
    import time

    time.sleep(seconds)  # stuck in user code (a data loader on a slow filesystem)
    yield from batches


def stuck_stage_case() -> str:
    """PP2 on 2 ranks with a 10 s group timeout: stage 0's data loader takes 18 s."""
    engine = _pipeline()
    data = _batch(engine)
    return _error(lambda: engine.train_batch(_slow(data, 18.0) if engine.stage_id == 0 else iter(data)))


def test_a_stage_stuck_in_user_code_is_named_by_its_neighbour_after_the_group_timeout():
    stuck, waiting = run_distributed(stuck_stage_case, 2, comm_timeout_s=10, timeout_s=300)
    assert waiting.startswith(
        "PipelineError: rank 1 (pipeline stage 1): nothing came from rank 0 (pipeline stage 0) within the process "
        "group's timeout (0:00:10): it is stuck or gone"
    ), waiting
    assert stuck.startswith("StageAborted: rank 0 (pipeline stage 0): ") and "rank 1 (pipeline stage 1)" in stuck, stuck
