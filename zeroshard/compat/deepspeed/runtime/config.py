"""``deepspeed.runtime.config``: DeepSpeed's config error is zeroshard's; ``DeepSpeedConfig`` reads a config the way
zeroshard's engine does (DeepSpeed's monitor tutorial builds one outside an engine)."""

from __future__ import annotations

import os
from typing import Any, Union

from zeroshard.config import ConfigError as DeepSpeedConfigError
from zeroshard.config import ZeroshardConfig, parse_config


class DeepSpeedConfig:
    """A validated config (a dict or a JSON file's path; ``mpu`` / ``mesh_device`` are refused). Its keys read as
    attributes of the validated config (``cfg.zero_optimization.stage``); ``monitor_config`` is what
    ``MonitorMaster`` takes, and ``train_batch_size`` / ``gradient_accumulation_steps`` what the file says."""

    def __init__(self, config: Union[dict, str, os.PathLike], mpu: Any = None, mesh_device: Any = None):
        if mpu is not None or mesh_device is not None:
            raise NotImplementedError("DeepSpeedConfig(mpu=..., mesh_device=...): pass the config only")
        self._config: ZeroshardConfig = parse_config(config)

    @property
    def monitor_config(self) -> ZeroshardConfig:
        return self._config

    @property
    def zero_optimization_stage(self) -> int:
        return self._config.zero_optimization.stage

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._config, name)


__all__ = ["DeepSpeedConfig", "DeepSpeedConfigError"]
