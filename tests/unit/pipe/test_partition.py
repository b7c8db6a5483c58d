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


def test_the_time_partition_makes_the_slowest_stage_as_fast_as_can_be():
    """``partition_min_max`` against every split (brute force) of seeded weight vectors: its largest run is the
    smallest any split has, and every stage holds a layer."""
    import itertools
    import random

    from zeroshard.pipe.partition import partition_min_max

    rng = random.Random(3)
    for _ in range(200):
        count, parts = rng.randint(1, 9), rng.randint(1, 4)
        weights = [rng.choice([0.0, rng.uniform(0, 5), 1.0]) for _ in range(count)]
        bounds = partition_min_max(weights, parts)
        assert bounds[0] == 0 and bounds[-1] == count and len(bounds) == parts + 1
        if count <= parts:
            continue
        assert all(a < b for a, b in zip(bounds, bounds[1:]))
        largest = max(sum(weights[a:b]) for a, b in zip(bounds, bounds[1:]))
        best = min(
            max(sum(weights[a:b]) for a, b in zip((0, *cut), (*cut, count)))
            for cut in itertools.combinations(range(1, count), parts - 1)
        )
        assert largest == pytest.approx(best)
    with pytest.raises(ValueError, match="finite numbers"):
        partition_min_max([1.0, float("nan")], 2)


def test_layer_times_build_each_layer_once_and_include_the_loss():
    import torch
    from torch import nn

    from zeroshard.pipe import LayerSpec, TiedLayerSpec
    from zeroshard.pipe.profile import layer_times

    built = []

    class Counted(nn.Linear):
        def __init__(self, *args):
            super().__init__(*args)
            built.append(type(self).__name__)

    specs = [TiedLayerSpec("e", Counted, 8, 8), LayerSpec(Counted, 8, 8), torch.tanh,
             TiedLayerSpec("e", Counted, 8, 8, forward_fn=lambda m, x: m(x))]  # fmt: skip
    losses = []

    def loss_fn(out, labels):
        losses.append(labels)
        return (out - labels).square().mean()

    times = layer_times(specs, (torch.randn(4, 8), torch.zeros(4, 8)), loss_fn)
    assert len(times) == 4 and all(t > 0 for t in times)
    assert built == ["Counted", "Counted"]  # the tie built once
    assert len(losses) == 3  # the last layer's runs (the first warms up) include the loss
    with pytest.raises(ValueError, match=r"profile_batch=\(inputs, labels\)"):
        layer_times(specs, torch.randn(4, 8), loss_fn)
