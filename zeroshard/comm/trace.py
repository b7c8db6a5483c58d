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
_PACKAGE_DIR = os.path.dirname(_COMM_DIR)
_TORCH_DIR = os.path.dirname(os.path.abspath(__import__("torch").__file__))
_INTERNAL = (_PACKAGE_DIR + os.sep, _TORCH_DIR + os.sep)  # frames between the user's code and the collective
_KEY = "zeroshard/trace/{rank}"
_EXIT_KEY = "zeroshard/exit/{rank}"  # set by a rank whose script ended normally: its last collective's number


@dataclass(frozen=True)
class TraceEntry:
    seq: int  # this rank's collective count: the same collective has the same number on every rank
    op: str
    group: str
    shape: tuple
    dtype: str
    site: str  # the user's file:line (first frame outside zeroshard), with the zeroshard frame beside it

    def signature(self) -> tuple:
        return (self.op, self.group, tuple(self.shape), self.dtype)

    def describe(self) -> str:
        what = f" of {tuple(self.shape)} {self.dtype.removeprefix('torch.')}" if self.dtype else ""
        return f"{self.op} on '{self.group}'{what} at {self.site}"


def _where(frame) -> str:
    name = frame.f_code.co_filename
    if name.startswith("<"):
        return f"{name}:{frame.f_lineno}"
    path = os.path.abspath(name)
    if path.startswith(_PACKAGE_DIR + os.sep):
        path = os.path.join("zeroshard", os.path.relpath(path, _PACKAGE_DIR))
    else:
        path = os.path.relpath(path)
    return f"{path}:{frame.f_lineno}"


def _call_site() -> str:
    """``train.py:12``, or ``train.py:12 (zeroshard/zero/flat_group.py:150)`` when zeroshard code issued the
    collective on the user's behalf: the user's frame says which step of their script, ours which mechanism."""
    frame = sys._getframe(2)
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == _COMM_DIR:
        frame = frame.f_back
    ours = None
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_INTERNAL):
        if ours is None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR + os.sep):
            ours = frame
        frame = frame.f_back
    if frame is None:
        return _where(ours) if ours is not None else "?"
    return _where(frame) + (f" ({_where(ours)})" if ours is not None else "")


class CollectiveTrace:
    """The recent collectives of this process (cheap: one frame walk and one tuple per collective)."""

    def __init__(self, size: int = 256):
        self.entries: deque[TraceEntry] = deque(maxlen=size)
        self.seq = 0

    def record(self, op: str, group: str, shape: tuple, dtype: str) -> TraceEntry:
        self.seq += 1
        entry = TraceEntry(self.seq, op, group, tuple(shape), dtype, _call_site())
        self.entries.append(entry)
        return entry

    def to_json(self) -> str:
        return json.dumps([asdict(e) for e in self.entries])

    @staticmethod
    def from_json(text: str) -> list[TraceEntry]:
        return [TraceEntry(**{**e, "shape": tuple(e["shape"])}) for e in json.loads(text)]


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, ranks))


def describe_divergence(
    traces: dict[int, list[TraceEntry]],
    world_size: int,
    exited: Optional[dict[int, int]] = None,
    waiting: Optional[tuple[int, TraceEntry]] = None,
) -> str:
    """Name the ranks whose script ended (``exited``: rank -> number of its last collective) and where the
    failing rank waits (``waiting``: rank, entry), then the first collective the still-running ranks disagree
    on, and the ranks that did not report."""
    exited = exited or {}
    lead = [f"rank {r} exited normally after collective #{seq} (its script ended)" for r, seq in sorted(exited.items())]
    if exited and waiting is not None:
        rank, entry = waiting
        lead.append(f"rank {rank} is waiting in collective #{entry.seq} {entry.describe()}")
    silent = [r for r in range(world_size) if r not in traces and r not in exited]
    notes = [f"{_ranks(silent)} did not report (exited, crashed, or stuck outside a collective)"] if silent else []
    notes = [*lead, *notes]
    traces = {r: t for r, t in traces.items() if r not in exited}
    reporting = {r: {e.seq: e for e in entries} for r, entries in traces.items()}
    if not reporting or (lead and len(reporting) == 1):
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
        return "; ".join([*lead, f"collective #{seq}: " + "; ".join(parts) + f" while {theirs}", *notes[len(lead) :]])
    tail = next(iter(reporting.values()))
    last_entry = tail.get(last)
    agreed = f"the reporting ranks agree on their last {last - first + 1} collective(s)"
    if last_entry is not None:
        agreed += f" (last: #{last} {last_entry.describe()})"
    return "; ".join([*lead, agreed, *notes[len(lead) :]])


def announce_exit(store, rank: int, trace: CollectiveTrace) -> None:
    """A rank whose script ended normally says so, with its trace, before it leaves: a rank still waiting in a
    collective then reads "rank 1 exited normally after collective #13" instead of "did not report"."""
    try:
        store.set(_KEY.format(rank=rank), trace.to_json())
        store.set(_EXIT_KEY.format(rank=rank), str(trace.seq))
    except Exception:  # the store may already be gone (its host rank ended first)
        pass


def diagnose(
    store, rank: int, world_size: int, wait_s: float, trace: CollectiveTrace, waiting: Optional[TraceEntry] = None
) -> str:
    """Publish this rank's trace, collect the others' (and their exit notes) for up to ``wait_s`` seconds,
    describe the divergence. ``waiting`` is the collective this rank failed in."""
    try:
        store.set(_KEY.format(rank=rank), trace.to_json())
    except Exception as err:  # the store may be gone with a dead rank 0
        return f"(no trace comparison: the store is unreachable: {err})"
    traces = {rank: list(trace.entries)}
    exited: dict[int, int] = {}
    deadline = time.monotonic() + wait_s
    pending = [r for r in range(world_size) if r != rank]
    while pending and time.monotonic() < deadline:
        for other in list(pending):
            key = _KEY.format(rank=other)
            try:
                if store.check([key]):
                    traces[other] = CollectiveTrace.from_json(store.get(key).decode())
                    pending.remove(other)
            except Exception:  # an unreachable store ends the wait
                pending = []
                break
        if pending:
            time.sleep(0.2)
    for other in traces:
        try:
            if other != rank and store.check([_EXIT_KEY.format(rank=other)]):
                exited[other] = int(store.get(_EXIT_KEY.format(rank=other)).decode())
        except Exception:
            break
    return describe_divergence(traces, world_size, exited, (rank, waiting) if waiting is not None else None)
