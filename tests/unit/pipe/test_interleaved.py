"""Interleaved 1F1B (``zeroshard.pipe.interleaved``, a ``PipelineModule`` of ``stages_per_rank`` k): run on paper for
2-8 ranks, 2-4 stages per rank and every multiple of p micro-batches up to 16, every rank runs to its end, each
micro-batch forward and backward once per stage it runs, holding at most 2 (p - r - 1) + (k - 1) p + 1 stages'
activations; on the unit clock its bubble is (p - 1) / (k m + p - 1), 1F1B's divided by about k; the module builds
stages r, r + p, ...; and the refusals."""

import pytest
import torch
from torch import nn

from zeroshard.pipe import LayerSpec, PipelineModule, simulate
from zeroshard.pipe.interleaved import Interleaved1F1BSchedule
from zeroshard.pipe.simulate import bubbles


@pytest.mark.parametrize("stages", range(2, 9))
@pytest.mark.parametrize("chunks", [2, 3, 4])
def test_interleaved_1f1b_runs_to_the_end_on_every_rank_holding_what_it_states(stages, chunks):
    for m in range(stages, 17, stages):
        make = lambda s, m=m: Interleaved1F1BSchedule(m, stages, s, chunks=chunks)  # noqa: E731
        traces = simulate(make, stages, training=True)
        for rank, trace in enumerate(traces):
            each = sorted(list(range(m)) * chunks)  # once per stage the rank runs
            assert sorted(trace.forwards) == sorted(trace.backwards) == each
            assert trace.peak_in_flight == min(2 * (stages - rank - 1) + (chunks - 1) * stages + 1, chunks * m)
        assert bubbles(traces) == pytest.approx([(stages - 1) / (chunks * m + stages - 1)] * stages)
        evaluate = lambda s, m=m: Interleaved1F1BSchedule(m, stages, s, chunks=chunks, forward_only=True)  # noqa: E731
        for trace in simulate(evaluate, stages, training=False):
            assert sorted(trace.forwards) == sorted(list(range(m)) * chunks) and not trace.backwards


def test_groups_of_p_micro_batches_go_through_the_stages_in_turn():
    """Megatron's order: rank r's i-th forward is micro-batch group * p + i % p on its stage (i // p) % k; backwards
    take the stages in reverse."""
    schedule = Interleaved1F1BSchedule(4, 2, 0, chunks=2)
    assert [schedule.work(i, backward=False) for i in range(8)] == [
        (0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3)
    ]  # fmt: skip
    assert [schedule.work(i, backward=True) for i in range(4)] == [(1, 0), (1, 1), (0, 0), (0, 1)]
    assert [schedule.owner(v) for v in range(4)] == [0, 1, 0, 1] and schedule.virtual_stage(1) == 2


@pytest.mark.parametrize(
    "args, message",
    [
        ((4, 2, 0, 1), "interleaved 1F1B runs 2 or more stages per rank, got 1"),
        ((4, 2, 0, True), "interleaved 1F1B runs 2 or more stages per rank, got True"),
        ((3, 2, 0, 2), "divisible by them: got 3 micro-batches on 2"),
        ((4, 1, 0, 2), "needs 2 or more pipeline ranks"),
    ],
)
def test_what_interleaved_1f1b_cannot_run_is_refused(args, message):
    with pytest.raises(ValueError, match=message):
        Interleaved1F1BSchedule(*args[:3], chunks=args[3])


def test_the_module_builds_its_stages_around_the_loop():
    """One process stands for rank 0 of 1 with 3 stages per rank: layers by their index in the whole model, each
    stage's forward behind ``activate_phase``."""
    layers = [LayerSpec(nn.Linear, 4, 4) for _ in range(6)]
    module = PipelineModule(layers, num_stages=1, partition_method="uniform", stages_per_rank=3)
    assert module.num_stages == 3 and module.parts == [0, 2, 4, 6]
    assert module.phase_bounds == [(0, 2), (2, 4), (4, 6)]
    x = torch.randn(2, 4)
    module.activate_phase(2)
    torch.testing.assert_close(module(x), getattr(module, "5")(getattr(module, "4")(x)))
    assert [module.stage_owner(i) for i in range(6)] == [0] * 6
    for bad in (0, -1, "2", True):
        with pytest.raises(ValueError, match="stages_per_rank must be an int >= 1"):
            PipelineModule(layers, num_stages=1, stages_per_rank=bad)
    with pytest.raises(ValueError, match=r"6 layers cannot fill the 8 stages of 1 pipeline ranks \(8 per rank"):
        PipelineModule(layers, num_stages=1, stages_per_rank=8)
