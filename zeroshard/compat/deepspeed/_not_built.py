"""Names DeepSpeed's clients import for features zeroshard does not build (sparse attention, DeepSpeed's CUDA kernels
and their builders, its transformer layer, curriculum learning, ...).

Importing them works, so a script or a training stack that imports a name and never calls it runs; calling one,
constructing one (a subclass too), or using it as a context manager raises ``NotImplementedError`` naming the
DeepSpeed path and why. An ``ImportError`` at import would kill every client that merely imports the name.
"""

from __future__ import annotations

from typing import Any


class NotBuilt:
    """Base of the placeholders: a class (clients subclass DeepSpeed's classes and test ``isinstance`` against them)
    whose construction is the refusal."""

    deepspeed_path = ""
    reason = ""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            f"{self.deepspeed_path} is not implemented by zeroshard ({self.reason}); see docs/deepspeed-compat.md"
        )


def not_built(deepspeed_path: str, reason: str, **constants: Any) -> type:
    """A placeholder for ``deepspeed_path`` (its last part is the name), refused with ``reason`` when used;
    ``constants`` are class attributes DeepSpeed's class has that clients read without constructing it."""
    name = deepspeed_path.rpartition(".")[2]
    return type(name, (NotBuilt,), {"deepspeed_path": deepspeed_path, "reason": reason, "__doc__": reason, **constants})


__all__ = ["NotBuilt", "not_built"]
