"""Hang forensics: every rank keeps a ring buffer of its recent collectives (sequence number, op, group,
shape, dtype, call site). When a collective fails or times out, the ranks publish their buffers in the
process group's key-value store and each failing rank names the first collective where the ranks
disagree: "rank 1 called all_gather at model.py:88 while ranks 0,2,3 called reduce_scatter at ...".

``describe_divergence`` is pure (traces in, sentence out); ``diagnose`` does the exchange.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass
from typing import Optional

_COMM_DIR = os.path.dirname(os.path.abspath(__file__))
_KEY = "zeroshard/trace/{rank}"


@dataclass(frozen=True)
class TraceEntry:
    seq: int  # this rank's collective count: the same collective has the same number on every rank
    op: str
    group: str
    shape: tuple
    dtype: str
    site: str  # file:line of the code that issued it (the first frame outside zeroshard.comm)

    def signature(self) -> tuple:
        return (self.op, self.group, tuple(self.shape), self.dtype)

    def describe(self) -> str:
        what = f" of {tuple(self.shape)} {self.dtype.removeprefix('torch.')}" if self.dtype else ""
        return f"{self.op} on '{self.group}'{what} at {self.site}"


def _call_site() -> str:
    frame = sys._getframe(2)
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == _COMM_DIR:
        frame = frame.f_back
    if frame is None:
        return "?"
    name = frame.f_code.co_filename
    return f"{name if name.startswith('<') else os.path.relpath(name)}:{frame.f_lineno}"


class CollectiveTrace:
    """The recent collectives of this process (cheap: one frame walk and one tuple per collective)."""

    def __init__(self, size: int = 256):
        self.entries: deque[TraceEntry] = deque(maxlen=size)
        self.seq = 0

    def record(self, op: str, group: str, shape: tuple, dtype: str) -> None:
        self.seq += 1
        self.entries.append(TraceEntry(self.seq, op, group, tuple(shape), dtype, _call_site()))

    def to_json(self) -> str:
        return json.dumps([asdict(e) for e in self.entries])

    @staticmethod
    def from_json(text: str) -> list[TraceEntry]:
        return [TraceEntry(**{**e, "shape": tuple(e["shape"])}) for e in json.loads(text)]


TRACE = CollectiveTrace()


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, ranks))


def describe_divergence(traces: dict[int, list[TraceEntry]], world_size: int) -> str:
    """Name the first collective the ranks disagree on, and the ranks that did not report."""
    silent = [r for r in range(world_size) if r not in traces]
    notes = [f"{_ranks(silent)} did not report (exited, crashed, or stuck outside a collective)"] if silent else []
    reporting = {r: {e.seq: e for e in entries} for r, entries in traces.items()}
    if not reporting:
        return "; ".join(notes)
    first = max(min(t) if t else 1 for t in reporting.values())  # oldest collective every buffer still holds
    last = max(max(t) if t else 0 for t in reporting.values())
    for seq in range(first, last + 1):
        by_signature: dict[Optional[tuple], list[int]] = {}
        for rank, entries in sorted(reporting.items()):
            entry = entries.get(seq)
            by_signature.setdefault(entry.signature() if entry else None, []).append(rank)
        if len(by_signature) == 1:
            continue
        counts = Counter({sig: len(ranks) for sig, ranks in by_signature.items()})
        majority = max(by_signature, key=lambda sig: (counts[sig], sig is not None))
        parts = []
        for sig, ranks in by_signature.items():
            if sig is majority:
                continue
            if sig is None:
                previous = reporting[ranks[0]].get(seq - 1)
                after = f" (its last was {previous.describe()})" if previous else ""
                parts.append(f"{_ranks(ranks)} issued no collective #{seq}{after}")
            else:
                parts.append(f"{_ranks(ranks)} called {reporting[ranks[0]][seq].describe()}")
        agreed = by_signature[majority]
        if majority is None:
            theirs = f"{_ranks(agreed)} issued none"
        else:
            theirs = f"{_ranks(agreed)} called {reporting[agreed[0]][seq].describe()}"
        return "; ".join([f"collective #{seq}: " + "; ".join(parts) + f" while {theirs}", *notes])
    tail = next(iter(reporting.values()))
    last_entry = tail.get(last)
    agreed = f"the reporting ranks agree on their last {last - first + 1} collective(s)"
    if last_entry is not None:
        agreed += f" (last: #{last} {last_entry.describe()})"
    return "; ".join([agreed, *notes])


def diagnose(store, rank: int, world_size: int, wait_s: float) -> str:
    """Publish this rank's trace, collect the others' for up to ``wait_s`` seconds, describe the divergence."""
    try:
        store.set(_KEY.format(rank=rank), TRACE.to_json())
    except Exception as err:  # noqa: BLE001 - the store may be gone with a dead rank 0
        return f"(no trace comparison: the store is unreachable: {err})"
    traces = {rank: list(TRACE.entries)}
    deadline = time.monotonic() + wait_s
    pending = [r for r in range(world_size) if r != rank]
    while pending and time.monotonic() < deadline:
        for other in list(pending):
            key = _KEY.format(rank=other)
            try:
                if store.check([key]):
                    traces[other] = CollectiveTrace.from_json(store.get(key).decode())
                    pending.remove(other)
            except Exception:  # noqa: BLE001 - an unreachable store ends the wait
                pending = []
                break
        if pending:
            time.sleep(0.2)
    return describe_divergence(traces, world_size)
