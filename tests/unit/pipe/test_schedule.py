"""The schedules: every instruction of ``TrainSchedule`` and ``InferenceSchedule`` is DeepSpeed 0.19.8's, step by
step (``tests/fixtures/deepspeed_pipe``: 1-6 micro-batches, 1-4 stages); run on paper for 1-8 stages and 1-16
micro-batches (``zeroshard.pipe.simulate``: asynchronous sends, blocking receives) every stage runs to its end, each
micro-batch forward and backward once per stage, stage ``s`` of ``p`` holding at most ``min(p - s, m)``; and the
simulation names a schedule that deadlocks, mixes micro-batches up or overwrites a slot."""

import json
import pathlib

import pytest

from zeroshard.pipe import (
    DataParallelSchedule,
    InferenceSchedule,
    PipeSchedule,
    ScheduleError,
    TrainSchedule,
    simulate,
)
from zeroshard.pipe.instructions import (
    BackwardPass,
    ForwardPass,
    LoadMicroBatch,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    SendActivation,
    SendGrad,
)

EXPECTED = json.loads((pathlib.Path(__file__).parents[2] / "fixtures" / "deepspeed_pipe" / "expected.json").read_text())


def stream(schedule) -> str:
    return "|".join(";".join(repr(c) for c in cmds) for cmds in schedule.steps())


@pytest.mark.parametrize("kind", [TrainSchedule, InferenceSchedule])
def test_every_instruction_is_deepspeeds(kind):
    recorded = EXPECTED["streams"][kind.__name__]
    assert len(recorded) == 60
    for key, expected in recorded.items():
        m, p, s = map(int, key.split(","))
        assert stream(kind(micro_batches=m, stages=p, stage_id=s)) == expected, key


@pytest.mark.parametrize("stages", range(1, 9))
def test_1f1b_runs_to_the_end_on_every_stage_holding_what_it_states(stages):
    for micro_batches in range(1, 17):
        traces = simulate(lambda s, m=micro_batches: TrainSchedule(m, stages, s), stages, training=True)
        for s, trace in enumerate(traces):
            assert trace.forwards == trace.backwards == list(range(micro_batches))
            assert trace.peak_in_flight == min(stages - s, micro_batches)
        traces = simulate(lambda s, m=micro_batches: InferenceSchedule(m, stages, s), stages, training=False)
        assert all(t.forwards == list(range(micro_batches)) and not t.backwards for t in traces)


def test_the_data_parallel_example_runs_on_one_stage():
    (trace,) = simulate(lambda s: DataParallelSchedule(5, 1, s), 1, training=True)
    assert trace.forwards == trace.backwards == list(range(5)) and trace.peak_in_flight == 1


def test_the_compute_order_is_deepspeeds():
    for m, p, s, order in EXPECTED["schedules"]:
        compute = [
            c for cmds in TrainSchedule(m, p, s).steps() for c in cmds if isinstance(c, (ForwardPass, BackwardPass))
        ]
        assert "".join("f" if isinstance(c, ForwardPass) else "b" for c in compute) == order


class _Listed(PipeSchedule):
    """A schedule given as one list of instructions per stage (all in one step)."""

    programs: list = []

    def steps(self):
        yield list(self.programs[self.stage_id])


def listed(programs: list, training: bool = True):
    kind = type("Listed", (_Listed,), {"programs": programs})
    return simulate(lambda s: kind(1, len(programs), s), len(programs), training)


def test_a_receive_nobody_sends_first_is_a_deadlock_naming_each_stage():
    first = [LoadMicroBatch(0), ForwardPass(0), RecvGrad(0), SendActivation(0), BackwardPass(0)]
    last = [RecvActivation(0), LoadMicroBatch(0), ForwardPass(0), BackwardPass(0), SendGrad(0)]
    with pytest.raises(ScheduleError, match=r"deadlocks.*stage 0 at step 0: RecvGrad\(buffer_id=0\)"):
        listed([first, last])
    first = [LoadMicroBatch(0), ForwardPass(0), SendActivation(0), RecvGrad(0), BackwardPass(0)]
    (a, b) = listed([first, last])
    assert a.backwards == b.backwards == [0]


def test_a_forward_before_its_inputs_and_a_slot_overwritten_are_named():
    with pytest.raises(ScheduleError, match=r"ForwardPass\(buffer_id=0\): slot 0 holds no inputs"):
        listed([[ForwardPass(0)]])
    with pytest.raises(ScheduleError, match="slot 0 still holds the inputs of micro-batch 0"):
        simulate(lambda s: _Twice(2, 1, s), 1, training=True)


class _Twice(PipeSchedule):
    def steps(self):
        yield [LoadMicroBatch(0), ForwardPass(0), LoadMicroBatch(0)]


class _Swapped(PipeSchedule):
    """The last stage pairs micro-batch 1's activations with micro-batch 0's labels."""

    def steps(self):
        if self.stage_id == 0:
            yield [LoadMicroBatch(i) for i in (0, 1)] + [ForwardPass(0), ForwardPass(1), SendActivation(1)]
            yield [SendActivation(0), RecvGrad(1), BackwardPass(1), RecvGrad(0), BackwardPass(0)]
        else:
            yield [LoadMicroBatch(0), LoadMicroBatch(1), RecvActivation(0), ForwardPass(0)]
            yield [RecvActivation(1), ForwardPass(1), BackwardPass(0), SendGrad(0), BackwardPass(1), SendGrad(1)]


def test_activations_paired_with_another_micro_batchs_labels_are_named():
    with pytest.raises(ScheduleError, match="stage 1.*labels of micro-batch 0, not of 1"):
        simulate(lambda s: _Swapped(2, 2, s), 2, training=True)


class _StepsEarly(TrainSchedule):
    def steps(self):
        commands = [c for cmds in super().steps() for c in cmds]
        yield [OptimizerStep()] + [c for c in commands if not isinstance(c, OptimizerStep)]


def test_the_batch_end_before_a_micro_batchs_work_is_named():
    with pytest.raises(ScheduleError, match=r"comes after OptimizerStep\(\)"):
        simulate(lambda s: _StepsEarly(2, 2, s), 2, training=True)


class _NotAList(TrainSchedule):
    def steps(self):
        yield ReduceGrads()


def test_a_step_that_is_not_a_list_of_instructions_is_named():
    with pytest.raises(ScheduleError, match="yielded ReduceGrads, not a list"):
        simulate(lambda s: _NotAList(2, 2, s), 2, training=True)


def test_a_micro_batch_never_run_is_named():
    with pytest.raises(ScheduleError, match="each of the 2 micro-batches runs forward and backward once"):
        simulate(lambda s: _OneOfTwo(2, 1, s), 1, training=True)


class _OneOfTwo(PipeSchedule):
    def steps(self):
        yield [LoadMicroBatch(0), ForwardPass(0), BackwardPass(0)]


def test_diffusion_pipes_reordering_pairs_labels_as_deepspeeds():
    """diffusion-pipe's ``TrainSchedule.steps`` loads before exchanging; written here from its description (the file
    itself runs in ``tests/distributed/test_diffusion_pipe.py``): the same instructions, the load moved first."""

    class LoadFirst(TrainSchedule):
        def steps(self):
            for cmds in super().steps():
                loads = [c for c in cmds if isinstance(c, LoadMicroBatch)]
                yield loads + [c for c in cmds if not isinstance(c, LoadMicroBatch)]

    for stages in range(1, 6):
        for micro_batches in range(1, 9):
            simulate(lambda s, m=micro_batches, p=stages: LoadFirst(m, p, s), stages, training=True)


@pytest.mark.parametrize("args", [(2, 2, 2), (4, 2, -1), (4, 0, 0), (0, 2, 0), (True, 2, 0), (4.0, 2, 0)])
def test_a_stage_that_does_not_exist_is_a_named_error(args):
    micro_batches, stages, stage_id = args
    with pytest.raises(ValueError, match="pipeline schedule"):
        TrainSchedule(micro_batches, stages, stage_id)
