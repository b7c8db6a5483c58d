"""The speculation policy (pure) and the verdict's bookkeeping, without processes: zeroshard/zero/speculation.py.
The bit-for-bit results are tests/distributed/test_speculation.py."""

import math
import random

import pytest
import torch

from zeroshard.zero.speculation import Speculation, SpeculationPolicy, would_commit


def run(policy: SpeculationPolicy, verdicts: list[bool]) -> tuple[int, int]:
    """Feed one verdict per step (True: clean); return (steps speculated, replays)."""
    speculated = replays = 0
    for clean in verdicts:
        speculating = policy.speculating
        speculated += speculating
        replays += speculating and not clean
        policy.record(speculating, clean)
    return speculated, replays


def test_a_run_that_never_clips_always_speculates():
    assert run(SpeculationPolicy(), [True] * 500) == (500, 0)


def test_a_run_that_clips_every_step_replays_three_times_then_stops():
    assert run(SpeculationPolicy(), [False] * 10_000) == (3, 3)


def test_it_starts_again_after_three_clean_steps_in_a_row():
    policy = SpeculationPolicy()
    run(policy, [False] * 50)
    assert not policy.speculating
    run(policy, [True, True])
    assert not policy.speculating
    run(policy, [True])
    assert policy.speculating


@pytest.mark.parametrize(
    "clipped,speculated_at_least,replays_at_most",
    [(0.01, 0.999, 0.011), (0.1, 0.99, 0.11), (0.3, 0.8, 0.3), (0.9, 0.0, 0.005)],
)
def test_clipping_at_random_costs_replays_in_proportion(clipped, speculated_at_least, replays_at_most):
    """A clip that triggers on a random share of 10000 steps (measured for the docs): rare clipping barely stops
    speculation, clipping on most steps stops it."""
    rng = random.Random(0)
    verdicts = [rng.random() >= clipped for _ in range(10_000)]
    speculated, replays = run(SpeculationPolicy(), verdicts)
    assert speculated >= speculated_at_least * len(verdicts) and replays <= replays_at_most * len(verdicts)


@pytest.mark.parametrize(
    "norm,clip,clean",
    [(0.5, 1.0, True), (1.0, 1.0, True), (1.5, 1.0, False), (1e9, 0.0, True), (math.inf, 0.0, False),
     (math.nan, 1.0, False), (math.nan, 0.0, False)],
)  # fmt: skip
def test_would_commit(norm, clip, clean):
    assert would_commit(norm, clip) is clean


class Adam:
    """A real torch optimizer over one parameter, and a 'home' whose speculate steps a copy (the worker's job)."""

    def __init__(self):
        self.param = torch.nn.Parameter(torch.ones(4))
        self.optimizer = torch.optim.AdamW([self.param], lr=0.1)
        self.stepped: list[tuple[int, float]] = []

    def speculate(self, index, coef, optimizer):
        self.stepped.append((index, coef))
        if index == 99:
            raise OSError("disk gone")
        return 2


@pytest.fixture
def home():
    return Adam()


@pytest.fixture
def speculation(home):
    """A real worker thread over ``home`` (rank 3), closed after the test."""
    speculation = Speculation(3, home.speculate, 0.5, SpeculationPolicy())
    yield speculation
    speculation.close()


def test_hyperparameters_changed_after_backward_replay_instead_of_committing(home, speculation):
    """A learning rate set between backward and step (as a client may do by hand): the speculation used the old
    one, so the verdict replays it."""
    speculation.arm(4.0, home.optimizer)
    speculation.offer(0)
    speculation.offer(1)
    home.optimizer.param_groups[0]["lr"] = 0.2
    done, commit = speculation.resolve(True, 4.0, home.optimizer, lambda index: 100)
    assert done == {0: 2, 1: 2} and not commit
    assert speculation.stats.replayed == 4 and speculation.stats.replay_bytes == 200
    assert home.stepped == [(0, 0.25), (1, 0.25)]

    def clean_steps_until_it_speculates():  # the policy's pause after each replay
        while not speculation.policy.speculating:
            speculation.resolve(True, 4.0, home.optimizer, lambda index: 1)

    clean_steps_until_it_speculates()
    # unchanged and clean: committed
    speculation.arm(4.0, home.optimizer)
    speculation.offer(0)
    done, commit = speculation.resolve(True, 4.0, home.optimizer, lambda index: 100)
    assert done == {0: 2} and commit and speculation.stats.committed == 2
    # a changed loss scale, or a flat group offered twice (a second backward), replays too
    speculation.arm(4.0, home.optimizer)
    speculation.offer(0)
    assert not speculation.resolve(True, 2.0, home.optimizer, lambda index: 1)[1]
    clean_steps_until_it_speculates()
    speculation.arm(4.0, home.optimizer)
    speculation.offer(0)
    speculation.offer(0)
    assert not speculation.resolve(True, 4.0, home.optimizer, lambda index: 1)[1]


def test_a_failed_speculation_raises_its_own_error_naming_rank_and_flat_group(home, speculation):
    speculation.arm(1.0, home.optimizer)
    speculation.offer(0)
    speculation.offer(99)
    with pytest.raises(OSError, match="disk gone") as raised:
        speculation.wait()
    assert "rank 3" in "".join(raised.value.__notes__) and "flat group 99" in "".join(raised.value.__notes__)
    assert not speculation.armed and speculation.abandon() == {0: 2}  # what it stepped, to discard
