"""Training metrics: CSV always available (``csv_monitor``), TensorBoard, Weights & Biases and Comet when their
block is enabled (each needs its package). Rank 0 writes; DeepSpeed's event names (``Train/Samples/...``, the step
being the samples seen) and CSV layout (``<output_path>/<job_name>/<event>.csv`` with ``step,value`` rows)."""

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


def _import(package: str, block: str):
    import importlib

    try:
        return importlib.import_module(package)
    except ImportError as err:
        raise ImportError(
            f"config block '{block}' is enabled but the {package} package is missing: pip install {package} "
            f"(or set {block}.enabled to false)"
        ) from err


class WandbMonitor:
    """One ``wandb`` run (``project``, ``group``, ``team`` as the entity); each event is logged at its step. The
    package's own settings apply (``WANDB_MODE=offline`` keeps the run on disk)."""

    def __init__(self, block):
        wandb = _import("wandb", "wandb")
        self.run = wandb.init(project=block.project, group=block.group, entity=block.team)

    def write(self, events: list[tuple[str, float, int]]) -> None:
        for name, value, step in events:
            self.run.log({name: value}, step=step)

    def close(self) -> None:
        self.run.finish()


class CometMonitor:
    """One Comet experiment (``comet_ml.start`` with the block's keys; ``mode``/``online`` as Comet reads them);
    an event name is logged again once ``samples_log_interval`` samples have passed since it was last logged."""

    def __init__(self, block):
        comet_ml = _import("comet_ml", "comet")
        self.experiment = comet_ml.start(
            api_key=block.api_key,
            project=block.project,
            workspace=block.workspace,
            experiment_key=block.experiment_key,
            mode=block.mode,
            online=block.online,
        )
        if block.experiment_name is not None:
            self.experiment.set_name(block.experiment_name)
        self.interval = block.samples_log_interval
        self._last_logged: dict[str, int] = {}

    def write(self, events: list[tuple[str, float, int]]) -> None:
        for name, value, step in events:
            last = self._last_logged.get(name)
            if last is None or step - last >= self.interval:
                self._last_logged[name] = step
                self.experiment.log_metric(name, value, step=step)

    def close(self) -> None:
        self.experiment.end()


class Monitors:
    """The enabled monitors of a run (none on ranks other than 0). DeepSpeed's ``engine.monitor``:
    ``write_events([(name, value, step), ...])`` writes a client's own events to every enabled monitor."""

    def __init__(self, config, rank: int):
        self.sinks: list = []
        if rank != 0:
            return
        if config.csv_monitor.enabled:
            self.sinks.append(CsvMonitor(config.csv_monitor.output_path, config.csv_monitor.job_name))
        if config.tensorboard.enabled:
            self.sinks.append(TensorBoardMonitor(config.tensorboard.output_path, config.tensorboard.job_name))
        if config.wandb.enabled:
            self.sinks.append(WandbMonitor(config.wandb))
        if config.comet.enabled:
            self.sinks.append(CometMonitor(config.comet))

    @property
    def enabled(self) -> bool:
        return bool(self.sinks)

    def write(self, events: list[tuple[str, Optional[float], int]]) -> None:
        events = [(name, float(value), step) for name, value, step in events if value is not None]
        for sink in self.sinks:
            sink.write(events)

    def write_events(self, event_list: list[tuple[str, Optional[float], int]]) -> None:
        """DeepSpeed's name for :meth:`write`."""
        self.write(list(event_list))

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
