"""The ``gradient_check`` block as a careless or hostile config writes it, and the check's pure parts without a
process group (the multi-rank behaviour: ``tests/distributed/test_gradient_check.py``)."""

from __future__ import annotations

import math

import pytest
import torch

from zeroshard.config import parse_config


@pytest.mark.parametrize(
    "block,field",
    [
        ({"enabled": "yes"}, "enabled"),
        ({"enabled": True, "interval": 0}, "interval"),
        ({"enabled": True, "interval": -5}, "interval"),
        ({"enabled": True, "interval": 2.5}, "interval"),
        ({"enabled": True, "projections": 0}, "projections"),
        ({"enabled": True, "projections": 10**6}, "projections"),
        ({"enabled": True, "seed": -1}, "seed"),
        ({"enabled": True, "seed": float("nan")}, "seed"),
        ({"enabled": True, "tolerance": 0.1}, "tolerance"),  # not a key: the tolerance is derived
    ],
)
def test_bad_values_are_refused_naming_the_key(block, field):
    with pytest.raises(ValueError, match=f"gradient_check.*{field}|{field}.*gradient_check"):
        parse_config({"train_micro_batch_size_per_gpu": 1, "gradient_check": block})


def test_off_by_default_and_read_as_written():
    assert not parse_config({"train_micro_batch_size_per_gpu": 1}).gradient_check.enabled
    check = parse_config(
        {"train_micro_batch_size_per_gpu": 1, "gradient_check": {"enabled": True, "interval": 100, "projections": 4}}
    ).gradient_check
    assert (check.enabled, check.interval, check.projections, check.seed) == (True, 100, 4, 0)


def test_projection_rows_are_the_same_numbers_for_a_whole_parameter_and_for_its_pieces():
    """The reduced side projects shards (pieces of parameters at any offset) on the rows the gradient side drew for
    whole parameters: both must see the same numbers, across block boundaries too."""
    from zeroshard.zero import gradient_check
    from zeroshard.zero.gradient_check import GradientCheck

    class Flat:
        device = torch.device("cpu")

    class Bucket:
        flat = Flat()

    check = GradientCheck([Bucket()], group=None, world=None, names=[["w"]], projections=3, seed=7)
    numel = 2 * gradient_check.BLOCK + 5
    values = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    whole = check._project(0, 0, 0, values, numel)
    cuts = [0, 17, gradient_check.BLOCK - 1, gradient_check.BLOCK + 3, numel]
    pieces = sum(check._project(0, 0, lo, values[lo:hi], numel) for lo, hi in zip(cuts, cuts[1:]))
    assert torch.allclose(whole, pieces, rtol=1e-5)
    assert whole[1].min() > 0 and whole[2].min() > 0 and math.isfinite(float(whole.sum()))
