"""Training metrics to files: CSV always available (``csv_monitor``), TensorBoard when its block is enabled
(``tensorboard``; the optional ``tensorboard`` package). Rank 0 writes; DeepSpeed's event names and layout
(``<output_path>/<job_name>/<event>.csv`` with ``step,value`` rows)."""

from __future__ import annotations

import csv
import os
from typing import Optional


class CsvMonitor:
    def __init__(self, output_path: str, job_name: str):
        self.directory = os.path.join(output_path or "csv_monitor", job_name)
        os.makedirs(self.directory, exist_ok=True)
        self._files: dict[str, object] = {}

    def write(self, events: list[tuple[str, float, int]]) -> None:
        for name, value, step in events:
            if name not in self._files:
                path = os.path.join(self.directory, name.replace("/", "_") + ".csv")
                fresh = not os.path.exists(path)
                handle = open(path, "a", newline="")
                if fresh:
                    csv.writer(handle).writerow(["step", name])
                self._files[name] = handle
            csv.writer(self._files[name]).writerow([step, value])
        for handle in self._files.values():
            handle.flush()

    def close(self) -> None:
        for handle in self._files.values():
            handle.close()
        self._files.clear()


class TensorBoardMonitor:
    def __init__(self, output_path: str, job_name: str):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ImportError(
                "config block 'tensorboard' is enabled but the tensorboard package is missing: "
                "pip install tensorboard (or set tensorboard.enabled to false)"
            ) from err
        self.writer = SummaryWriter(log_dir=os.path.join(output_path or "runs", job_name))

    def write(self, events: list[tuple[str, float, int]]) -> None:
        for name, value, step in events:
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class Monitors:
    """The enabled monitors of a run (none on ranks other than 0)."""

    def __init__(self, config, rank: int):
        self.sinks: list = []
        if rank != 0:
            return
        if config.csv_monitor.enabled:
            self.sinks.append(CsvMonitor(config.csv_monitor.output_path, config.csv_monitor.job_name))
        if config.tensorboard.enabled:
            self.sinks.append(TensorBoardMonitor(config.tensorboard.output_path, config.tensorboard.job_name))

    @property
    def enabled(self) -> bool:
        return bool(self.sinks)

    def write(self, events: list[tuple[str, Optional[float], int]]) -> None:
        events = [(name, float(value), step) for name, value, step in events if value is not None]
        for sink in self.sinks:
            sink.write(events)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
