"""Loss scaling for fp16 as a small pure state machine, fed one overflow flag per optimizer step."""

from __future__ import annotations

from dataclasses import dataclass


class LossScaleStuckError(RuntimeError):
    """Gradients overflow even at the minimum loss scale: training cannot make progress."""


@dataclass
class LossScaler:
    """Dynamic when ``dynamic`` is set: halve after ``hysteresis`` overflows, double after ``window`` clean steps.

    A static scaler keeps its scale but still reports overflowing steps (they are skipped).
    """

    scale: float = 1.0
    dynamic: bool = False
    window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_scale: float = 1.0
    max_stuck_steps: int = 20
    clean_steps: int = 0
    hysteresis_left: int = 2
    stuck_steps: int = 0

    @classmethod
    def from_config(cls, fp16) -> "LossScaler":
        """From the ``fp16`` config section; a disabled section gives the identity scaler."""
        if not fp16.enabled:
            return cls()
        if fp16.loss_scale > 0:
            return cls(scale=float(fp16.loss_scale))
        return cls(
            scale=float(2**fp16.initial_scale_power),
            dynamic=True,
            window=fp16.loss_scale_window,
            hysteresis=fp16.hysteresis,
            consecutive_hysteresis=fp16.consecutive_hysteresis,
            min_scale=float(fp16.min_loss_scale),
            hysteresis_left=fp16.hysteresis,
        )

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            self.clean_steps = 0
            at_minimum = self.scale <= self.min_scale
            if self.hysteresis_left > 1:
                self.hysteresis_left -= 1
            else:
                self.scale = max(self.scale / 2, self.min_scale)
            self.stuck_steps = self.stuck_steps + 1 if at_minimum else 0
            if self.stuck_steps >= self.max_stuck_steps:
                raise LossScaleStuckError(
                    f"gradients overflowed for {self.stuck_steps} consecutive steps at the minimum loss scale "
                    f"{self.min_scale}; lower the learning rate, check the data for inf/nan, or use bf16"
                )
            return
        self.stuck_steps = 0
        self.clean_steps += 1
        if self.consecutive_hysteresis:
            self.hysteresis_left = self.hysteresis
        if self.clean_steps >= self.window:
            self.scale *= 2
            self.clean_steps = 0
            self.hysteresis_left = self.hysteresis

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("scale", "clean_steps", "hysteresis_left", "stuck_steps")}

    def load_state_dict(self, state: dict) -> None:
        """Only the four progress fields; the policy (dynamic, window, minimum) is this run's config."""
        for key in ("scale", "clean_steps", "hysteresis_left", "stuck_steps"):
            value = state.get(key, getattr(self, key))
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ValueError(f"loss scaler state '{key}' = {value!r} is not a non-negative number")
            setattr(self, key, type(getattr(self, key))(value))
