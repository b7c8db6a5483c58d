"""The user-facing training runtime: initialize() and the engine."""

from .engine import ZeroshardEngine
from .initialize import add_config_arguments, initialize

__all__ = ["ZeroshardEngine", "add_config_arguments", "initialize"]
