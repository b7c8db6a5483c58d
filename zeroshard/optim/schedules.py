"""DeepSpeed's learning-rate schedules, as pure functions of the step plus one small stepping class.

Each curve is ``lr(step) -> float`` for one parameter group; :class:`ScheduleRunner` applies it to
an optimizer's groups. Parameter names and defaults are DeepSpeed's, so configs port unchanged.
"""

from __future__ import annotations

import inspect
import math
import warnings
from typing import Any, Callable, Optional

import torch

Curve = Callable[[int], float]
WARMUP_TYPES = ("log", "linear")


def _warmup_fraction(step: int, warmup_steps: int, warmup_type: str) -> float:
    """Fraction of the warmup done after ``step`` (0-based) steps: log or linear."""
    warmup_steps = max(2, warmup_steps)
    step = max(step, 0)  # before the first step() DeepSpeed reports the warmup start
    if step >= warmup_steps:
        return 1.0
    if warmup_type == "log":
        return math.log(step + 1) / math.log(warmup_steps)
    return step / warmup_steps


def _check_warmup(warmup_num_steps: Any, warmup_type: str) -> None:
    if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
        raise ValueError(f"scheduler.params.warmup_num_steps must be a positive integer, got {warmup_num_steps!r}")
    if warmup_type not in WARMUP_TYPES:
        raise AssertionError(f"warmup_type {warmup_type!r} reached a curve unresolved (resolve_params replaces it)")


def warmup_lr(
    base_lr: float,
    warmup_min_lr: float = 0.0,
    warmup_max_lr: Optional[float] = None,
    warmup_num_steps: int = 1000,
    warmup_type: str = "log",
) -> Curve:
    _check_warmup(warmup_num_steps, warmup_type)
    top = base_lr if warmup_max_lr is None else warmup_max_lr
    return lambda step: warmup_min_lr + (top - warmup_min_lr) * _warmup_fraction(step, warmup_num_steps, warmup_type)


def warmup_decay_lr(
    base_lr: float,
    total_num_steps: int,
    warmup_min_lr: float = 0.0,
    warmup_max_lr: float = 0.001,
    warmup_num_steps: int = 1000,
    warmup_type: str = "log",
) -> Curve:
    _check_warmup(warmup_num_steps, warmup_type)
    warm = max(2, warmup_num_steps)

    def curve(step: int) -> float:
        if step < warm:
            gamma = _warmup_fraction(step, warm, warmup_type)
        else:
            gamma = max(0.0, (total_num_steps - step) / max(1.0, total_num_steps - warm))
        return warmup_min_lr + (warmup_max_lr - warmup_min_lr) * gamma

    return curve


def warmup_cosine_lr(
    base_lr: float,
    total_num_steps: int,
    warmup_min_ratio: float = 0.0,
    warmup_num_steps: int = 1000,
    cos_min_ratio: float = 0.0001,
    warmup_type: str = "log",
) -> Curve:
    _check_warmup(warmup_num_steps, warmup_type)
    return lambda step: (
        base_lr
        * warmup_cosine_ratio(step, total_num_steps, warmup_min_ratio, warmup_num_steps, cos_min_ratio, warmup_type)
    )


def warmup_cosine_ratio(
    step: int,
    total_num_steps: int,
    warmup_min_ratio: float = 0.0,
    warmup_num_steps: int = 1000,
    cos_min_ratio: float = 0.0001,
    warmup_type: str = "log",
) -> float:
    """WarmupCosineLR's factor of each group's base lr after ``step`` steps (DeepSpeed's ``get_lr_ratio``)."""
    warm = max(2, warmup_num_steps)
    if step < warm:
        return warmup_min_ratio + (1 - warmup_min_ratio) * _warmup_fraction(step, warm, warmup_type)
    progress = min(1.0, (step - warm + 1) / max(1, total_num_steps - warm))
    return max(0.0, cos_min_ratio + (1 - cos_min_ratio) * (1 + math.cos(math.pi * progress)) / 2)


def lr_range_test(
    base_lr: float,
    lr_range_test_min_lr: float = 1e-3,
    lr_range_test_step_size: int = 2000,
    lr_range_test_step_rate: float = 1.0,
    lr_range_test_staircase: bool = False,
) -> Curve:
    def curve(step: int) -> float:
        if step < 0:
            return lr_range_test_min_lr
        interval = (step + 1) / lr_range_test_step_size
        if lr_range_test_staircase:
            interval = math.floor(interval)
        return lr_range_test_min_lr * (1 + lr_range_test_step_rate * interval)

    return curve


def _one_cycle_scale(step: int, first: float, second: float, first_stairs: int, second_stairs: int) -> float:
    total = first + second
    iteration = step + 1
    x = 1.0 + iteration / total - math.floor(1 + iteration / total)
    ratio = first / total
    if x <= ratio:
        scale, stairs = x / ratio, first_stairs
    else:
        scale, stairs = (x - 1) / (ratio - 1), second_stairs
    if stairs > 0:
        position = iteration % total
        steps_in = position * stairs / first if position <= first else (total - position) * stairs / second
        scale = math.floor(steps_in) / stairs
    return scale


def one_cycle(
    base_lr: float,
    cycle_min_lr: float,
    cycle_max_lr: float,
    decay_lr_rate: float = 0.0,
    cycle_first_step_size: int = 2000,
    cycle_second_step_size: Optional[int] = None,
    cycle_first_stair_count: int = 0,
    cycle_second_stair_count: Optional[int] = None,
    decay_step_size: int = 0,
    **momentum_keys: Any,
) -> Curve:
    first = float(cycle_first_step_size)
    second = float(cycle_second_step_size) if cycle_second_step_size is not None else first
    second_stairs = cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count

    def curve(step: int) -> float:
        if step < 0:
            return cycle_min_lr
        if step < first + second:
            scale = _one_cycle_scale(step, first, second, cycle_first_stair_count, second_stairs)
            return cycle_min_lr + (cycle_max_lr - cycle_min_lr) * scale
        if decay_step_size == 0 or decay_lr_rate == 0:
            return cycle_min_lr
        return cycle_min_lr / (1 + decay_lr_rate * (step - first - second + 1) / decay_step_size)

    return curve


def one_cycle_momentum(
    cycle_first_step_size: int = 2000,
    cycle_second_step_size: Optional[int] = None,
    cycle_first_stair_count: int = 0,
    cycle_second_stair_count: Optional[int] = None,
    decay_step_size: int = 0,
    cycle_momentum: bool = True,
    cycle_min_mom: float = 0.8,
    cycle_max_mom: float = 0.9,
    decay_mom_rate: float = 0.0,
    **lr_keys: Any,
) -> Optional[Curve]:
    """beta1 moves inversely to the learning rate during the cycle (DeepSpeed keeps beta2 at 0.99)."""
    if not cycle_momentum:
        return None
    first = float(cycle_first_step_size)
    second = float(cycle_second_step_size) if cycle_second_step_size is not None else first
    second_stairs = cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count

    def curve(step: int) -> float:
        if step < first + second:  # before the first step (-1) too: scale 0, the cycle maximum
            scale = _one_cycle_scale(step, first, second, cycle_first_stair_count, second_stairs)
            return cycle_max_mom - (cycle_max_mom - cycle_min_mom) * scale
        if decay_step_size == 0 or decay_mom_rate == 0:
            return cycle_max_mom
        return cycle_max_mom * (1 + decay_mom_rate * (step - first - second + 1) / decay_step_size)

    return curve


SCHEDULES: dict[str, Callable[..., Curve]] = {
    "WarmupLR": warmup_lr,
    "WarmupDecayLR": warmup_decay_lr,
    "WarmupCosineLR": warmup_cosine_lr,
    "OneCycle": one_cycle,
    "LRRangeTest": lr_range_test,
}


class ScheduleRunner:
    """Sets each parameter group's lr (and beta1 for OneCycle) from a curve; state is one step counter.

    Curves take the 0-based index of the last step taken; -1 means before the first ``step()``.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        curves: list[Curve],
        momentum: Optional[list[Curve]] = None,
        initial_beta1: Optional[list[float]] = None,
        params: Optional[list[dict[str, Any]]] = None,
    ):
        self.optimizer = optimizer
        self.curves = curves
        self.momentum = momentum  # per parameter group: beta1 by step (OneCycle)
        self.initial_beta1 = initial_beta1  # per parameter group: beta1 before the first step
        self.params = params or [{} for _ in curves]  # per parameter group: the parameters as resolved
        self.last_batch_iteration = -1
        self._apply(-1)  # the lr before the first step(), as DeepSpeed sets it at construction

    def _apply(self, step: int) -> None:
        momentum = self.get_mom()
        if step < 0 and momentum is not None and self.initial_beta1 is not None:
            # DeepSpeed's OneCycle starts the optimizer at cycle_min_mom, while its get_mom() already answers the
            # first step's value (cycle_max_mom): both kept
            momentum = [(beta1, beta2) for beta1, (_, beta2) in zip(self.initial_beta1, momentum)]
        for i, (group, curve) in enumerate(zip(self.optimizer.param_groups, self.curves)):
            if torch.is_tensor(group["lr"]):  # a caller's tensor lr (for compiled steps) keeps its identity
                group["lr"].fill_(curve(step))
            else:
                group["lr"] = curve(step)
            if momentum is not None and "betas" in group:
                group["betas"] = momentum[i]
        self._last_lr = [float(g["lr"]) for g in self.optimizer.param_groups]

    def get_mom(self) -> Optional[list[tuple[float, float]]]:
        """OneCycle's (beta1, beta2) per parameter group at the last step, beta2 fixed at 0.99 as in DeepSpeed;
        ``None`` for a schedule that does not cycle momentum."""
        if self.momentum is None:
            return None
        return [(curve(self.last_batch_iteration), 0.99) for curve in self.momentum]

    def step(self, last_batch_iteration: Optional[int] = None) -> None:
        self.last_batch_iteration = (
            self.last_batch_iteration + 1 if last_batch_iteration is None else last_batch_iteration
        )
        self._apply(self.last_batch_iteration)

    def get_last_lr(self) -> list[float]:
        return list(self._last_lr)

    def get_lr(self) -> list[float]:
        return self.get_last_lr()

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict) -> None:
        self.last_batch_iteration = state["last_batch_iteration"]
        self._apply(self.last_batch_iteration)


def build_schedule(name: str, params: dict[str, Any], optimizer: torch.optim.Optimizer) -> ScheduleRunner:
    """The schedule ``name`` (``scheduler.type``) with ``params`` (``scheduler.params``) over ``optimizer``."""
    return ScheduleRunner(optimizer, *schedule_parts(name, params, optimizer))


# parameters DeepSpeed takes per parameter group (a list of one value per group) as well as for all of them
PER_GROUP = {
    "WarmupLR": ("warmup_min_lr", "warmup_max_lr"),
    "WarmupDecayLR": ("warmup_min_lr", "warmup_max_lr"),
    "WarmupCosineLR": (),
    "OneCycle": ("cycle_min_lr", "cycle_max_lr", "cycle_min_mom", "cycle_max_mom"),
    "LRRangeTest": ("lr_range_test_min_lr",),
}
LEARNING_RATES = ("warmup_min_lr", "warmup_max_lr", "cycle_min_lr", "cycle_max_lr", "lr_range_test_min_lr")


def schedule_parts(name: str, params: dict[str, Any], optimizer: torch.optim.Optimizer) -> tuple:
    """(curves, momentum curves, initial beta1s, resolved parameters), one of each per parameter group: what a
    :class:`ScheduleRunner` is built from."""
    if name not in SCHEDULES:
        raise ValueError(f"config key 'scheduler.type' = {name!r}: expected one of {sorted(SCHEDULES)}")
    params = dict(params)
    params.pop("last_batch_iteration", None)
    resolved = resolve_params(name, params, len(optimizer.param_groups))
    factory = SCHEDULES[name]
    try:
        curves = [factory(float(g["lr"]), **p) for g, p in zip(optimizer.param_groups, resolved)]
    except TypeError as err:
        raise ValueError(f"scheduler '{name}' rejected scheduler.params {params}: {err}") from None
    if name != "OneCycle" or "betas" not in optimizer.defaults:
        return curves, None, None, resolved
    momentum = [one_cycle_momentum(**p) for p in resolved]
    if any(curve is None for curve in momentum):  # cycle_momentum: false
        return curves, None, None, resolved
    return curves, momentum, [p["cycle_min_mom"] for p in resolved], resolved


def resolve_params(name: str, params: dict[str, Any], groups: int) -> list[dict[str, Any]]:
    """``params`` for each of ``groups`` parameter groups, defaults filled in, checked as DeepSpeed checks them (a
    ``ValueError`` naming the parameter): numbers are finite numbers; a per-group list has one value per group; step
    sizes are positive (OneCycle's second half may be 0); learning rates are not negative, and OneCycle's cycle does
    not go down; an unknown ``warmup_type`` is the log curve, with a warning, as in DeepSpeed."""
    for key, value in params.items():
        if isinstance(value, (list, tuple)) and key not in PER_GROUP[name]:
            raise ValueError(f"scheduler.params.{key} = {value!r}: {name} takes one value for every parameter group")
        if isinstance(value, (list, tuple)) and len(value) != groups:
            raise ValueError(f"scheduler.params.{key}: expected {groups} value(s), one per parameter group, got "
                             f"{len(value)}")  # fmt: skip
    known = _parameters(name)
    defaults = {key: p.default for key, p in known.items() if p.default is not inspect.Parameter.empty}
    per_group = [
        {**defaults, **{k: (v[i] if isinstance(v, (list, tuple)) else v) for k, v in params.items()}}
        for i in range(groups)
    ]
    for group in per_group:
        for key, value in group.items():
            if key not in known or key in _NOT_NUMBERS or value is None:
                continue  # an unknown key is the schedule's to refuse, by name
            if not _is_number(value) or not math.isfinite(value):
                raise ValueError(f"scheduler.params.{key} must be a finite number, got {value!r:.40}")
            if key in LEARNING_RATES and value < 0:
                raise ValueError(f"scheduler.params.{key} must be a finite learning rate >= 0, got {value!r}")
        _check_steps(name, group)
        if "warmup_type" in group and group["warmup_type"] not in WARMUP_TYPES:
            warnings.warn(
                f"scheduler.params.warmup_type {group['warmup_type']!r} is not 'log' or 'linear': the log warmup is "
                "used (as DeepSpeed does)",
                UserWarning,
                stacklevel=4,
            )
            group["warmup_type"] = "log"
    return per_group


_NOT_NUMBERS = ("warmup_type", "lr_range_test_staircase", "cycle_momentum")


def _parameters(name: str) -> dict[str, inspect.Parameter]:
    """Schedule ``name``'s parameters by name (OneCycle's momentum parameters included)."""
    factories = [SCHEDULES[name], *([one_cycle_momentum] if name == "OneCycle" else [])]
    return {
        key: parameter
        for factory in factories
        for key, parameter in inspect.signature(factory).parameters.items()
        if key != "base_lr" and parameter.kind is not inspect.Parameter.VAR_KEYWORD
    }


def _check_steps(name: str, group: dict[str, Any]) -> None:
    if name == "LRRangeTest":
        size = group["lr_range_test_step_size"]
        if not _is_integer(size) or size <= 0:
            raise ValueError(f"scheduler.params.lr_range_test_step_size must be a positive integer, got {size!r}")
    if name == "OneCycle":
        for key in ("cycle_min_lr", "cycle_max_lr"):
            if key not in group:
                raise ValueError(f"scheduler '{name}' needs scheduler.params.{key}")
        first, second = group["cycle_first_step_size"], group["cycle_second_step_size"]
        if first <= 0:
            raise ValueError(f"scheduler.params.cycle_first_step_size must be positive, got {first!r}")
        if second is not None and second < 0:
            raise ValueError(f"scheduler.params.cycle_second_step_size must be non-negative, got {second!r}")
        if group["cycle_min_lr"] > group["cycle_max_lr"]:
            raise ValueError(
                f"scheduler.params.cycle_min_lr {group['cycle_min_lr']} is above cycle_max_lr {group['cycle_max_lr']}: "
                "the cycle rises from cycle_min_lr to cycle_max_lr and back"
            )


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
