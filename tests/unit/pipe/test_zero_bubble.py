"""ZB-H1 (``zeroshard.pipe.zero_bubble``): on a clock where a forward, a B and a W each take one unit, a step of m
micro-batches over p stages takes 3m + p - 1 units when m >= p (1F1B: 3(m + p - 1)), never more than 1F1B; run on
paper every stage runs to its end for 1-8 stages and 1-16 micro-batches, each micro-batch forward, B and W once, and
no stage holds more than min(p, m) micro-batches."""

import pytest

from zeroshard.pipe import TrainSchedule, simulate
from zeroshard.pipe.instructions import BackwardInputPass, BackwardWeightPass, ForwardPass
from zeroshard.pipe.simulate import bubbles
from zeroshard.pipe.zero_bubble import ZeroBubbleH1Schedule, orders


@pytest.mark.parametrize("stages", range(1, 9))
def test_every_stage_runs_to_its_end_holding_at_most_1f1bs_peak(stages):
    for micro_batches in range(1, 17):
        traces = simulate(lambda s, m=micro_batches: ZeroBubbleH1Schedule(m, stages, s), stages, training=True)
        for trace in traces:
            assert trace.forwards == trace.backwards == list(range(micro_batches))
            assert trace.peak_in_flight == min(stages, micro_batches)
        span = max(trace.finished for trace in traces)
        assert span <= 3 * (micro_batches + stages - 1)
        if micro_batches >= stages:
            assert span == 3 * micro_batches + stages - 1, (stages, micro_batches, span)


def test_the_bubble_falls_to_a_third_of_1f1bs():
    """p = 4, m = 8: idle 3 units per stage of 27 (1F1B: 9 of 33, its formula (p - 1) / (m + p - 1))."""
    zero_bubble = simulate(lambda s: ZeroBubbleH1Schedule(8, 4, s), 4, training=True)
    assert [round(b, 4) for b in bubbles(zero_bubble)] == [round(3 / 27, 4)] * 4
    one_f_one_b = simulate(lambda s: TrainSchedule(8, 4, s), 4, training=True)
    assert [round(b, 4) for b in bubbles(one_f_one_b)] == [round(3 / 11, 4)] * 4
    assert orders(4, 8)[3][:6] == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]  # W's deferred


def test_each_operation_is_one_step_of_instructions():
    steps = list(ZeroBubbleH1Schedule(2, 2, 1).steps())
    assert [type(c).__name__ for c in steps[0]] == ["LoadMicroBatch", "RecvActivation", "ForwardPass"]
    assert [type(c).__name__ for c in steps[1]] == ["BackwardInputPass", "SendGrad"]
    assert [type(c).__name__ for c in steps[-1]][-4:] == ["BackwardWeightPass", "ReduceTiedGrads", "ReduceGrads",
                                                          "OptimizerStep"]  # fmt: skip
    kinds = [type(c) for cmds in steps for c in cmds]
    assert kinds.count(ForwardPass) == kinds.count(BackwardInputPass) == kinds.count(BackwardWeightPass) == 2
