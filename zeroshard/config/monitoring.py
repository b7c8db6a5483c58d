"""What a run reports: the ``comms_logger``, the monitors (``tensorboard``, ``csv_monitor``, ``wandb``, ``comet``)
and the ``flops_profiler``."""

from __future__ import annotations

from typing import Optional

from pydantic import Field, field_validator

from .section import Section, refused


class CommsLoggerConfig(Section):
    enabled: bool = False
    verbose: bool = False  # rank 0 prints every timed collective as it completes
    prof_all: bool = refused(True, "every op is counted")
    debug: bool = False  # the totals are also split by the call site that issued each collective
    prof_ops: list[str] = refused([], "every op is counted")


class MonitorConfig(Section):
    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"

    @field_validator("job_name")
    @classmethod
    def _plain_job_name(cls, value: str) -> str:
        # the monitor writes under output_path/job_name: a name with a path in it would write elsewhere
        if not value or value in (".", "..") or any(c in value for c in "/\\\0"):
            raise ValueError("must be a plain name (a directory under output_path): no '/', '\\', '..' or NUL")
        return value


class WandbConfig(Section):
    """DeepSpeed's ``wandb`` monitor block (``zeroshard.runtime.monitor.WandbMonitor``)."""

    enabled: bool = False
    group: Optional[str] = None
    team: Optional[str] = None
    project: str = "deepspeed"


class CometConfig(Section):
    """DeepSpeed's ``comet`` monitor block (``zeroshard.runtime.monitor.CometMonitor``)."""

    enabled: bool = False
    samples_log_interval: int = Field(100, ge=1)
    project: Optional[str] = None
    workspace: Optional[str] = None
    api_key: Optional[str] = None
    experiment_name: Optional[str] = None
    experiment_key: Optional[str] = None
    online: Optional[bool] = None
    mode: Optional[str] = None


class FlopsProfilerConfig(Section):
    """DeepSpeed's ``flops_profiler`` block: rank 0 profiles the forward of step ``profile_step`` (counted in
    optimizer steps taken before it, as DeepSpeed counts) and prints it after that step."""

    enabled: bool = False
    recompute_fwd_factor: float = Field(0.0, ge=0.0, le=1.0)
    profile_step: int = Field(1, ge=1)
    module_depth: int = Field(-1, ge=-1)
    top_modules: int = Field(1, ge=1)
    detailed: bool = True
    output_file: Optional[str] = None
