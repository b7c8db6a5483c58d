"""Checks of optimizer hyperparameters, with the config's strictness: a number is a finite number (not a bool, not a
string), a count is a whole number, each in its range. Shared by the optimizers built by name (``build_optimizer``,
which names the config key) and by the 1-bit optimizers' constructors (which a script may call itself).

Without them a NaN learning rate trained on to NaN weights, ``freeze_step: -5`` froze the variance at once, and
``freeze_step: "2"`` failed at the first step with a bare ``TypeError``.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional


def number(
    where: str,
    value: Any,
    *,
    low: Optional[float] = None,
    high: Optional[float] = None,
    low_open: bool = False,
    high_open: bool = False,
    whole: bool = False,
) -> float:
    """``value`` as a number in the range: ``[low, high]``, an end left out with ``*_open``; ``whole`` for counts
    (an integer, or a float with no fraction such as DeepSpeed configs write ``1e5``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        kind = "a whole number" if whole else "a number"
        raise ValueError(f"{where} must be {kind}, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value):
        raise ValueError(f"{where} must be a finite number, got {value}")
    if whole and value != int(value):
        raise ValueError(f"{where} must be a whole number, got {value}")
    below = low is not None and (value <= low if low_open else value < low)
    above = high is not None and (value >= high if high_open else value > high)
    if below or above:
        left = "(" if low_open else "["
        right = ")" if high_open else "]"
        span = f"{left}{'-inf' if low is None else f'{low:g}'}, {'inf' if high is None else f'{high:g}'}{right}"
        raise ValueError(f"{where} must be in {span}, got {value}")
    return int(value) if whole else value


def betas(where: str, value: Any) -> tuple[float, float]:
    """Two decay rates, each in [0, 1)."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or len(value) != 2:
        raise ValueError(f"{where} must be two numbers (beta1, beta2), got {value!r}")
    return tuple(number(f"{where}[{i}]", v, low=0.0, high=1.0, high_open=True) for i, v in enumerate(value))


def non_negative(where: str, value: Any) -> float:
    return number(where, value, low=0.0)


def positive(where: str, value: Any) -> float:
    return number(where, value, low=0.0, low_open=True)


def fraction(where: str, value: Any) -> float:
    return number(where, value, low=0.0, high=1.0)


def steps(where: str, value: Any) -> int:
    """A step count: a whole number >= 0."""
    return number(where, value, low=0, whole=True)


def at_least_one(where: str, value: Any) -> int:
    return number(where, value, low=1, whole=True)


def flag(where: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{where} must be true or false, got {value!r}")
    return value


# what each hyperparameter key means, whichever optimizer takes it
CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "lr": non_negative,
    "muon_lr": non_negative,  # Muon's own learning rates over lr
    "adam_lr": non_negative,
    "weight_decay": non_negative,
    "eps": positive,
    "betas": betas,
    "momentum": non_negative,
    "dampening": non_negative,
    "lr_decay": non_negative,
    "initial_accumulator_value": non_negative,
    "freeze_step": steps,
    "var_freeze_step": steps,
    "var_update_scaler": at_least_one,
    "local_step_scaler": at_least_one,
    "local_step_clipper": at_least_one,
    "max_coeff": positive,
    "min_coeff": non_negative,
    "coeff_beta": fraction,
    "factor_max": positive,
    "factor_min": non_negative,
    "factor_threshold": non_negative,
    "amsgrad": flag,
    "nesterov": flag,
    "maximize": flag,
    "cuda_aware": flag,
}


def check(prefix: str, params: dict[str, Any]) -> dict[str, Any]:
    """``params`` with every known key checked (an error names it ``{prefix}{key}``) and normalized (counts as
    ints, betas as a tuple), and the pairs that must agree compared."""
    checked = {key: CHECKS[key](f"{prefix}{key}", value) if key in CHECKS else value for key, value in params.items()}
    for low, high in (("min_coeff", "max_coeff"), ("factor_min", "factor_max")):
        if low in checked and high in checked and checked[low] > checked[high]:
            raise ValueError(f"{prefix}{low} ({checked[low]}) must not exceed {high} ({checked[high]})")
    return checked
