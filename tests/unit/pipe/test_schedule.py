"""The 1F1B order: per stage the forwards and backwards run in DeepSpeed 0.19.8's ``TrainSchedule`` order
(``tests/fixtures/deepspeed_pipe``: 1-6 micro-batches, 1-4 stages); with asynchronous sends and blocking receives
every stage runs to its end (no deadlock), holds at most ``stages - stage`` micro-batches' activations, and each
micro-batch's forward and backward run once per stage."""

import json
import pathlib

import pytest

from zeroshard.pipe import eval_steps, train_steps

EXPECTED = json.loads((pathlib.Path(__file__).parents[2] / "fixtures" / "deepspeed_pipe" / "expected.json").read_text())
SENDS = {"send_activation": ("recv_activation", +1), "send_grad": ("recv_grad", -1)}


def run_all(stages: int, programs: list[list]) -> list[list[tuple]]:
    """Every stage's steps, interleaved: a send deposits a message for its peer, a receive waits for one. Returns
    each stage's trace; raises when every unfinished stage waits (a deadlock)."""
    mailbox: set[tuple] = set()
    counters, traces = [0] * stages, [[] for _ in range(stages)]
    while any(c < len(p) for c, p in zip(counters, programs)):
        moved = False
        for s, program in enumerate(programs):
            while counters[s] < len(program):
                step = program[counters[s]]
                if step.kind.startswith("recv"):
                    if (step.kind, s, step.micro) not in mailbox:
                        break
                    mailbox.remove((step.kind, s, step.micro))
                elif step.kind in SENDS:
                    kind, direction = SENDS[step.kind]
                    mailbox.add((kind, s + direction, step.micro))
                traces[s].append((step.kind, step.micro))
                counters[s] += 1
                moved = True
        if not moved:
            raise AssertionError(f"deadlock at {counters} of {[len(p) for p in programs]}")
    assert not mailbox
    return traces


@pytest.mark.parametrize("micro_batches", range(1, 7))
@pytest.mark.parametrize("stages", range(1, 5))
def test_every_stage_runs_1f1b_to_the_end(stages, micro_batches):
    programs = [train_steps(s, stages, micro_batches) for s in range(stages)]
    traces = run_all(stages, programs)
    expected = {(m, p, s): order for m, p, s, order in EXPECTED["schedules"]}
    for s, trace in enumerate(traces):
        compute = [(kind, micro) for kind, micro in trace if kind in ("forward", "backward")]
        assert "".join(kind[0] for kind, _ in compute) == expected[(micro_batches, stages, s)]
        for kind in ("forward", "backward"):
            assert [m for k, m in compute if k == kind] == list(range(micro_batches))
        live = peak = 0
        for kind, _ in compute:
            live += 1 if kind == "forward" else -1
            peak = max(peak, live)
        assert peak <= stages - s


@pytest.mark.parametrize("stages", range(1, 5))
def test_evaluation_runs_forwards_only_in_order(stages):
    traces = run_all(stages, [eval_steps(s, stages, 3) for s in range(stages)])
    for trace in traces:
        assert [m for kind, m in trace if kind == "forward"] == [0, 1, 2]
        assert not any(kind in ("backward", "recv_grad", "send_grad") for kind, _ in trace)


@pytest.mark.parametrize("args", [(2, 2, 4), (-1, 2, 4), (0, 0, 4), (0, 2, 0), (0, 2, True), (0.0, 2, 4)])
def test_a_stage_that_does_not_exist_is_a_named_error(args):
    with pytest.raises(ValueError, match="pipeline schedule"):
        train_steps(*args)
