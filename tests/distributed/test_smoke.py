"""The inner loop's distributed check (``scripts/test.sh --quick``): stages 0-3 on 2 Gloo ranks, in one spawn, each
with gradient accumulation, against the single-process reference at the parity bar (fp32 <= 1e-5)."""

import pytest

from zeroshard.testing import run_distributed
from zeroshard.testing.parity import ParityCase, engine_train_many, model_error, reference_train

CASES = [ParityCase(stage=s, gas=2, lr=1e-3) for s in (0, 1, 2, 3)]


@pytest.fixture(scope="module")
def results():
    return run_distributed(engine_train_many, 2, CASES)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"stage{c.stage}" for c in CASES])
def test_every_stage_matches_the_reference(results, index):
    case = CASES[index]
    assert model_error(results[0][index]["params"], reference_train(case, 2)) <= 1e-5
    assert results[0][index]["params"].keys() == results[1][index]["params"].keys()
    assert results[0][index]["global_steps"] == case.steps
