"""Hyperparameters are checked with the config's strictness, for optimizers built by name and by a script."""

import math

import pytest
import torch

from zeroshard.optim import build_optimizer
from zeroshard.optim.onebit import OneBitAdam, OneBitLamb, ZeroOneAdam


def params():
    return [torch.nn.Parameter(torch.ones(2))]


@pytest.mark.parametrize(
    "cls, kwargs, message",
    [
        (OneBitAdam, {"lr": math.nan}, "OneBitAdam: lr must be a finite number, got nan"),
        (OneBitAdam, {"weight_decay": math.nan}, "OneBitAdam: weight_decay must be a finite number"),
        (OneBitAdam, {"lr": -1e-3}, r"OneBitAdam: lr must be in \[0, inf\]"),
        (OneBitAdam, {"freeze_step": -5}, r"OneBitAdam: freeze_step must be in \[0, inf\], got -5"),
        (OneBitAdam, {"freeze_step": math.nan}, "OneBitAdam: freeze_step must be a finite number"),
        (OneBitAdam, {"freeze_step": 2.5}, "OneBitAdam: freeze_step must be a whole number, got 2.5"),
        (OneBitAdam, {"freeze_step": True}, "OneBitAdam: freeze_step must be a whole number, got True"),
        (OneBitAdam, {"freeze_step": "2"}, "OneBitAdam: freeze_step must be a whole number, got '2'"),
        (OneBitAdam, {"betas": (1.5, 0.999)}, r"OneBitAdam: betas\[0\] must be in \[0, 1\), got 1.5"),
        (OneBitAdam, {"betas": (0.9,)}, "OneBitAdam: betas must be two numbers"),
        (OneBitAdam, {"eps": 0.0}, r"OneBitAdam: eps must be in \(0, inf\]"),
        (OneBitAdam, {"eps": -1e-8}, r"OneBitAdam: eps must be in \(0, inf\]"),
        (ZeroOneAdam, {"local_step_scaler": 0}, r"ZeroOneAdam: local_step_scaler must be in \[1, inf\]"),
        (ZeroOneAdam, {"local_step_clipper": 0}, r"ZeroOneAdam: local_step_clipper must be in \[1, inf\]"),
        (ZeroOneAdam, {"var_freeze_step": math.inf}, "ZeroOneAdam: var_freeze_step must be a finite number"),
        (OneBitLamb, {"max_coeff": 0.001, "min_coeff": 0.01}, r"min_coeff \(0.01\) must not exceed max_coeff"),
        (OneBitLamb, {"coeff_beta": 1.5}, r"OneBitLamb: coeff_beta must be in \[0, 1\]"),
    ],
)
def test_client_built_1bit_optimizers_refuse_bad_values_by_name(cls, kwargs, message):
    with pytest.raises(ValueError, match=message):
        cls(params(), **kwargs)


def test_whole_floats_are_counts_as_deepspeed_configs_write_them():
    assert OneBitAdam(params(), freeze_step=1e5).freeze_step == 100000


@pytest.mark.parametrize(
    "name, given, message",
    [
        ("OneBitAdam", {"freeze_step": "2"}, "optimizer.params.freeze_step must be a whole number, got '2'"),
        ("OneBitAdam", {"lr": math.nan}, "optimizer.params.lr must be a finite number"),
        ("AdamW", {"lr": "1e-3"}, "optimizer.params.lr must be a number, got '1e-3'"),
        ("AdamW", {"betas": [0.9]}, "optimizer.params.betas must be two numbers"),
        ("AdamW", {"weight_decay": True}, "optimizer.params.weight_decay must be a number, got True"),
        ("SGD", {"lr": 0.1, "momentum": -1}, r"optimizer.params.momentum must be in \[0, inf\], got -1"),
        ("Lamb", {"max_coeff": 1.0, "min_coeff": 2.0}, r"optimizer.params.min_coeff \(2.0\) must not exceed"),
        ("ZeroOneAdam", {"local_step_clipper": 0}, r"optimizer.params.local_step_clipper must be in \[1, inf\]"),
    ],
)
def test_optimizers_by_name_name_the_config_key(name, given, message):
    with pytest.raises(ValueError, match=message):
        build_optimizer(name, given, [{"params": params()}], zero_stage=0, allow_untested=False)
