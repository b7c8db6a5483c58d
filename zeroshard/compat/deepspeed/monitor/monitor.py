"""``deepspeed.monitor.monitor``: ``MonitorMaster(ds_config.monitor_config)`` as DeepSpeed's monitor tutorial builds
it outside an engine; zeroshard's monitors (``zeroshard.runtime.monitor``) write the events."""

from __future__ import annotations

from zeroshard import comm
from zeroshard.runtime.monitor import Monitors


class MonitorMaster(Monitors):
    """The monitors the config enables, on rank 0: ``write_events([(name, value, step), ...])``. ``monitor_config``
    is ``DeepSpeedConfig(...).monitor_config`` (a validated zeroshard config)."""

    def __init__(self, monitor_config):
        super().__init__(monitor_config, comm.get_rank())


__all__ = ["MonitorMaster"]
