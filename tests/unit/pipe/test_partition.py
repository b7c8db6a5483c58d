"""Where layers go: ``uniform`` and ``parameters`` / ``type:`` (balanced) place every layer on the stage DeepSpeed
0.19.8 places it (``tests/fixtures/deepspeed_pipe``: 300 weight vectors with zeros and ties); diffusion-pipe's
``manual`` boundaries are checked; bad input is a named error."""

import json
import pathlib

import pytest

from zeroshard.pipe import manual_boundaries, partition_balanced, partition_boundaries, partition_uniform

EXPECTED = json.loads((pathlib.Path(__file__).parents[2] / "fixtures" / "deepspeed_pipe" / "expected.json").read_text())


def test_uniform_partitions_equal_deepspeeds():
    assert len(EXPECTED["uniform"]) == 65
    for items, parts, bounds in EXPECTED["uniform"]:
        assert partition_uniform(items, parts) == bounds, (items, parts)


def test_balanced_partitions_equal_deepspeeds():
    assert len(EXPECTED["balanced"]) == 180
    for weights, parts, bounds in EXPECTED["balanced"]:
        assert partition_balanced(weights, parts) == bounds, (weights, parts)


def test_methods_by_name():
    counts, matches = [10, 100, 100, 100, 100, 10], [False, True, True, True, True, False]
    assert partition_boundaries("uniform", 2, counts, matches) == [0, 3, 6]
    assert partition_boundaries("Parameters", 2, counts, matches) == partition_balanced(counts, 2)
    assert partition_boundaries("type:Block", 2, counts, matches) == partition_balanced([0, 1, 1, 1, 1, 0], 2)
    assert manual_boundaries([2, 5], 8, 3) == [0, 2, 5, 8]


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: partition_boundaries("profile", 2, [1, 1], [True, True]), NotImplementedError, "'profile'"),
        (lambda: partition_boundaries("type:Block", 2, [1, 1], [False, False]), ValueError, "matches no layer"),
        (lambda: partition_balanced([1, float("nan")], 2), ValueError, "finite numbers"),
        (lambda: partition_balanced([1, -1], 2), ValueError, "finite numbers"),
        (lambda: partition_balanced([1, float("inf")], 2), ValueError, "finite numbers"),
        (lambda: partition_balanced([1, "2"], 2), ValueError, "finite numbers"),
        (lambda: partition_uniform(4, 0), ValueError, "number of parts"),
        (lambda: partition_uniform(-1, 2), ValueError, "number of items"),
        (lambda: manual_boundaries([3], 8, 3), ValueError, "gives 2 boundaries"),
        (lambda: manual_boundaries([5, 2], 8, 3), ValueError, "increasing"),
        (lambda: manual_boundaries([2, 9], 8, 3), ValueError, "increasing"),
        (lambda: manual_boundaries([2.5, 5], 8, 3), ValueError, "increasing"),
    ],
)
def test_bad_partition_input_is_a_named_error(call, error, message):
    with pytest.raises(error, match=message):
        call()
