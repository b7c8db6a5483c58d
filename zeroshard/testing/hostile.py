"""Hostile inputs for tests of the readers: what an attacker puts in a file zeroshard reads."""

from __future__ import annotations

import os


class CodeRunningPickle:
    """An object whose unpickling would run a shell command that creates ``marker`` (``__reduce__`` returns
    ``os.system``): saved into a checkpoint file, a safe reader refuses it by name and the marker never appears."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


__all__ = ["CodeRunningPickle"]
