"""Typed, validated configuration accepting DeepSpeed JSON keys."""

from .parse import ConfigSource, parse_config
from .resolve import AutoContext, BatchTriad, Resolution, model_hidden_size, resolve_batch_triad, resolve_config
from .schema import ZeroshardConfig
from .section import ConfigError
from .zero_optimization import OffloadDevice, ZeroConfig

__all__ = [
    "AutoContext",
    "BatchTriad",
    "ConfigError",
    "ConfigSource",
    "OffloadDevice",
    "Resolution",
    "ZeroConfig",
    "ZeroshardConfig",
    "model_hidden_size",
    "parse_config",
    "resolve_batch_triad",
    "resolve_config",
]
