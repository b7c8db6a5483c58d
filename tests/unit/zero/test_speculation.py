"""The speculation policy (pure) and the verdict's bookkeeping, without processes: zeroshard/zero/speculation.py.
The bit-for-bit results are tests/distributed/test_speculation.py."""

import math
import random

import pytest
import torch

from zeroshard.zero.speculation import MAX_PAUSE, Speculation, SpeculationPolicy, would_commit


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


def test_a_run_that_clips_every_step_replays_once():
    assert run(SpeculationPolicy(), [False] * 500) == (1, 1)


def test_after_a_replay_it_waits_for_clean_steps_in_a_row_and_the_wait_doubles():
    policy = SpeculationPolicy()
    policy.record(True, False)  # a replay: wait for 1 clean step
    assert not policy.speculating and policy.waiting == 1
    policy.record(False, False)  # would not have committed: the count restarts
    assert policy.waiting == 1
    policy.record(False, True)
    assert policy.speculating
    policy.record(True, False)  # the second replay asks for 2
    assert policy.waiting == 2
    policy.record(False, True)
    policy.record(False, False)
    assert policy.waiting == 2
    policy.record(False, True)
    policy.record(False, True)
    assert policy.speculating and policy.pause == 4


def test_the_pause_is_bounded_and_long_runs_of_commits_forgive():
    policy = SpeculationPolicy()
    for _ in range(20):
        policy.record(True, False)
        while not policy.speculating:
            policy.record(False, True)
    assert policy.pause == MAX_PAUSE
    for _ in range(MAX_PAUSE):
        policy.record(True, True)
    assert policy.pause == 1


def test_clipping_half_the_steps_at_random_costs_few_replays():
    """Measured for the docs: a clip that triggers on a random half of 10000 steps."""
    rng = random.Random(0)
    verdicts = [rng.random() < 0.5 for _ in range(10_000)]
    speculated, replays = run(SpeculationPolicy(), verdicts)
    assert replays < 200 and speculated > replays  # a replay every few dozen steps at most, then rarer


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


def test_hyperparameters_changed_after_backward_replay_instead_of_committing():
    """A learning rate set between backward and step (as a client may do by hand): the speculation used the old
    one, so the verdict replays it."""
    home = Adam()
    speculation = Speculation(0, home.speculate, 0.5, SpeculationPolicy())
    try:
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
    finally:
        speculation.close()


def test_a_failed_speculation_raises_its_own_error_naming_rank_and_flat_group():
    home = Adam()
    speculation = Speculation(3, home.speculate, 0.5, SpeculationPolicy())
    try:
        speculation.arm(1.0, home.optimizer)
        speculation.offer(0)
        speculation.offer(99)
        with pytest.raises(OSError, match="disk gone") as raised:
            speculation.wait()
        assert "rank 3" in "".join(raised.value.__notes__) and "flat group 99" in "".join(raised.value.__notes__)
        assert not speculation.armed and speculation.abandon() == {0: 2}  # what it stepped, to discard
    finally:
        speculation.close()
