"""The engines ``deepspeed.initialize`` built that are still alive, oldest first: DeepSpeed's module-level calls
(``safe_get_full_fp32_param`` and its family, the ``groups`` getters) answer from them, where DeepSpeed answers
from state it keeps per process. Held weakly, here only: an engine that is gone is forgotten."""

from __future__ import annotations

import weakref
from typing import Optional

from zeroshard.runtime import ZeroshardEngine

_ENGINES: list["weakref.ref[ZeroshardEngine]"] = []


def track(engine: ZeroshardEngine) -> None:
    """An engine ``deepspeed.initialize`` built."""
    _ENGINES.append(weakref.ref(engine))


def alive() -> list[ZeroshardEngine]:
    engines = [ref() for ref in _ENGINES]
    _ENGINES[:] = [ref for ref, engine in zip(_ENGINES, engines) if engine is not None]
    return [engine for engine in engines if engine is not None]


def newest() -> Optional[ZeroshardEngine]:
    engines = alive()
    return engines[-1] if engines else None
