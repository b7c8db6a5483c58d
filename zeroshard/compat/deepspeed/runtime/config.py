"""``deepspeed.runtime.config``: DeepSpeed's config error is zeroshard's."""

from zeroshard.config import ConfigError as DeepSpeedConfigError

__all__ = ["DeepSpeedConfigError"]
