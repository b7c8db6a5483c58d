"""DualPipeV (``zeroshard.pipe.dualpipev``): every instruction DeepSpeed 0.19.8's ``DualPipeVSchedule`` yields, for
training and evaluation (``tests/fixtures/deepspeed_pipe``: 1-4 ranks, 2p to 2p + 4 micro-batches); run on paper for
1-8 ranks and every micro-batch count from 2p to 16, with and without the B/W split: no deadlock, every micro-batch
forward and backward once per chunk, each rank holding at most 2p + 1 chunks' activations; the split runs every
weight pass once, after its input pass, in the places DeepSpeed's stream leaves empty; the module's two stages per
rank; and the refusals."""

import json
import pathlib

import pytest
import torch
from torch import nn

from zeroshard.pipe import DualPipeVModule, DualPipeVSchedule, LayerSpec, simulate
from zeroshard.pipe.instructions import BackwardInputPass, BackwardPass, BackwardWeightPass, CommitP2P

EXPECTED = json.loads((pathlib.Path(__file__).parents[2] / "fixtures" / "deepspeed_pipe" / "expected.json").read_text())


def stream(schedule) -> str:
    return "|".join(";".join(repr(c) for c in cmds) for cmds in schedule.steps())


@pytest.mark.parametrize("forward_only", [False, True])
def test_every_instruction_is_deepspeeds(forward_only):
    recorded = EXPECTED["streams"]["DualPipeVSchedule" + ("_forward_only" if forward_only else "")]
    assert len(recorded) == 50
    for key, expected in recorded.items():
        m, p, s = map(int, key.split(","))
        assert stream(DualPipeVSchedule(m, p, s, forward_only=forward_only)) == expected, key


@pytest.mark.parametrize("stages", range(1, 9))
@pytest.mark.parametrize("split", [False, True])
def test_dualpipev_runs_to_the_end_on_every_rank_holding_what_it_states(stages, split):
    for micro_batches in range(2 * stages, 17):
        make = lambda s, m=micro_batches: DualPipeVSchedule(m, stages, s, split_backward=split)  # noqa: E731
        for trace in simulate(make, stages, training=True):
            twice = sorted(list(range(micro_batches)) * 2)  # once per chunk
            assert sorted(trace.forwards) == sorted(trace.backwards) == twice
            assert trace.peak_in_flight == 2 * stages + 1, (stages, micro_batches)
        evaluate = lambda s, m=micro_batches: DualPipeVSchedule(m, stages, s, forward_only=True)  # noqa: E731
        for trace in simulate(evaluate, stages, training=False):
            assert sorted(trace.forwards) == sorted(list(range(micro_batches)) * 2) and not trace.backwards


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 8])
def test_the_split_fills_deepspeeds_empty_weight_chunks_and_changes_nothing_else(stages):
    """DeepSpeed's stream with each split backward's two halves put back together, and each weight pass taken out
    of the place DeepSpeed leaves empty, is DeepSpeed's stream: same slots, same exchanges, same order."""
    m = 2 * stages + 3
    for s in range(stages):
        plain = [repr(c) for cmds in DualPipeVSchedule(m, stages, s).steps() for c in cmds]
        split_cmds = [c for cmds in DualPipeVSchedule(m, stages, s, split_backward=True).steps() for c in cmds]
        inputs = [(c.buffer_id, c.phase) for c in split_cmds if isinstance(c, BackwardInputPass)]
        weights = [(c.buffer_id, c.phase) for c in split_cmds if isinstance(c, BackwardWeightPass)]
        assert inputs == weights and len(inputs) == 2 * (stages - s - 1) + s + 1  # each W once, oldest first
        merged = [
            repr(BackwardPass(c.buffer_id, phase=c.phase)) if isinstance(c, BackwardInputPass) else repr(c)
            for c in split_cmds
            if not isinstance(c, BackwardWeightPass)
        ]
        assert merged == plain
        # every W sits right after a CommitP2P DeepSpeed has there with nothing else (its "weight chunk")
        for index, command in enumerate(split_cmds):
            if isinstance(command, BackwardWeightPass):
                assert isinstance(split_cmds[index - 1], CommitP2P)


def test_the_v_places_two_stages_on_each_rank():
    schedule = DualPipeVSchedule(8, 4, 1)
    assert schedule.virtual_stages() == 8 and [schedule.virtual_stage(p) for p in (0, 1)] == [1, 6]
    assert [schedule.owner(v) for v in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert schedule.handoff_slot(3) == 11 and schedule.num_pipe_buffers() == 16


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_fewer_than_two_micro_batches_per_rank_are_refused(micro_batches):
    with pytest.raises(ValueError, match=r"DualPipeV needs at least 2 \* 2 micro-batches .* got " + str(micro_batches)):
        DualPipeVSchedule(micro_batches, 2, 0)


def test_the_module_builds_a_stage_on_the_way_out_and_one_on_the_way_back():
    """One process stands for rank 0 of 2: layers 0 and 3 of 4 (uniform), by their index in the whole model;
    ``forward`` runs the active phase's layers."""
    layers = [LayerSpec(nn.Linear, 4, 4) for _ in range(4)]
    module = DualPipeVModule(layers, num_stages=1, partition_method="uniform")
    assert module.num_stages == 2 and module.parts == [0, 2, 4] and module.phase_bounds == [(0, 2), (2, 4)]
    assert sorted({name.split(".")[0] for name, _ in module.named_parameters()}) == ["0", "1", "2", "3"]
    x = torch.randn(2, 4)
    module.activate_phase(1)
    out = module(x)
    torch.testing.assert_close(out, getattr(module, "3")(getattr(module, "2")(x)))
    assert [module.stage_owner(i) for i in range(4)] == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="phases 0 to 1"):
        module.activate_phase(2)


def test_a_module_with_fewer_layers_than_stages_is_refused():
    with pytest.raises(ValueError, match=r"1 layers cannot fill the 2 stages of 1 pipeline ranks \(2 per rank"):
        DualPipeVModule([LayerSpec(nn.Linear, 4, 4)], num_stages=1)


@pytest.mark.parametrize("stages", [2, 3, 4, 8])
def test_on_the_unit_clock_dualpipev_idles_less_than_1f1b_and_with_the_split_as_little_as_zb_h1(stages):
    """A chunk is half a 1F1B stage (the clock counts in chunks: 1F1B's units twice); DeepSpeed's order idles less
    than 1F1B's (p - 1) / (m + p - 1), the split as little as ZB-H1's (p - 1) / (3m + p - 1)."""
    from zeroshard.pipe import TrainSchedule
    from zeroshard.pipe.simulate import bubbles

    for m in range(2 * stages, 17):
        plain = bubbles(simulate(lambda s, m=m: DualPipeVSchedule(m, stages, s), stages, training=True))
        split = simulate(lambda s, m=m: DualPipeVSchedule(m, stages, s, split_backward=True), stages, training=True)
        one_f_one_b = bubbles(simulate(lambda s, m=m: TrainSchedule(m, stages, s), stages, training=True))
        assert max(plain) < min(one_f_one_b) == pytest.approx((stages - 1) / (m + stages - 1))
        assert bubbles(split) == pytest.approx([(stages - 1) / (3 * m + stages - 1)] * stages)
        assert max(t.finished for t in split) == 2 * (3 * m + stages - 1)
