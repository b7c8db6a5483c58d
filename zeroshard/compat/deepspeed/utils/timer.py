"""``deepspeed.utils.timer``: DeepSpeed's named wall-clock timers, which clients (ArcticTraining's metrics) build
themselves. Times are seconds of ``time.perf_counter`` after the device synchronized (so device work counts)."""

from __future__ import annotations

import time
from typing import Optional

from zeroshard.accelerator import get_accelerator

from .logging import print_dist


class SynchronizedWallClockTimer:
    """A registry of named :class:`Timer`\\ s: ``timers("forward").start()`` ... ``.stop()``,
    ``timers.log(["forward"])``."""

    class Timer:
        def __init__(self, name: str):
            self.name_ = name
            self.started_ = False
            self._start = 0.0
            self._intervals: list[float] = []  # seconds of each start-stop since the last reset

        def start(self) -> None:
            if self.started_:
                raise RuntimeError(f"timer '{self.name_}' has already been started")
            get_accelerator().synchronize()
            self._start = time.perf_counter()
            self.started_ = True

        def stop(self, reset: bool = False, record: bool = False) -> None:
            """``reset`` and ``record`` are accepted as DeepSpeed's (which ignores both)."""
            if not self.started_:
                raise RuntimeError(f"timer '{self.name_}' is not started")
            get_accelerator().synchronize()
            self._intervals.append(time.perf_counter() - self._start)
            self.started_ = False

        def reset(self) -> None:
            self.started_ = False
            self._intervals.clear()

        def elapsed(self, reset: bool = True) -> float:
            """Milliseconds timed since the last reset (a running timer is stopped and restarted around it)."""
            running = self.started_
            if running:
                self.stop()
            elapsed_ms = 1000.0 * sum(self._intervals)
            if reset:
                self.reset()
            if running:
                self.start()
            return elapsed_ms

        def mean(self) -> float:
            """The intervals' mean in milliseconds, the lowest and highest tenth left out (DeepSpeed's trim)."""
            ordered = sorted(1000.0 * t for t in self._intervals)
            cut = int(0.1 * len(ordered))
            kept = ordered[cut : len(ordered) - cut] or ordered
            return sum(kept) / len(kept) if kept else 0.0

    def __init__(self):
        self.timers: dict[str, SynchronizedWallClockTimer.Timer] = {}

    def get_timers(self) -> dict:
        return self.timers

    def __call__(self, name: str) -> "SynchronizedWallClockTimer.Timer":
        if name not in self.timers:
            self.timers[name] = self.Timer(name)
        return self.timers[name]

    def has(self, name: str) -> bool:
        return name in self.timers

    def log(
        self,
        names: list[str],
        normalizer: float = 1.0,
        reset: bool = True,
        memory_breakdown: bool = False,
        ranks: Optional[list[int]] = None,
    ) -> None:
        if normalizer <= 0:
            raise ValueError(f"timers.log(normalizer={normalizer}): must be positive")
        parts = [f"{n}: {self.timers[n].elapsed(reset=reset) / normalizer:.2f}" for n in names if n in self.timers]
        print_dist(" | ".join(["time (ms)", *parts]), ranks=ranks or [0])  # printed whatever the log level

    def get_mean(self, names: list[str], normalizer: float = 1.0, reset: bool = True) -> dict[str, float]:
        if normalizer <= 0:
            raise ValueError(f"timers.get_mean(normalizer={normalizer}): must be positive")
        return {n: self.timers[n].mean() * 1000.0 / normalizer for n in names if n in self.timers}  # DeepSpeed's scale


class NoopTimer:
    """DeepSpeed's stand-in when timing is off: the same calls, nothing timed."""

    class Timer:
        def start(self) -> None: ...

        def reset(self) -> None: ...

        def stop(self, **kwargs) -> None: ...

        def elapsed(self, **kwargs) -> float:
            return 0.0

        def mean(self) -> float:
            return 0.0

    def __init__(self):
        self.timer = self.Timer()

    def __call__(self, name: str) -> "NoopTimer.Timer":
        return self.timer

    def get_timers(self) -> dict:
        return {}

    def log(self, names, normalizer=1.0, reset=True, memory_breakdown=False, ranks=None) -> None: ...

    def get_mean(self, names, normalizer=1.0, reset=True) -> dict:
        return {}


__all__ = ["NoopTimer", "SynchronizedWallClockTimer"]
