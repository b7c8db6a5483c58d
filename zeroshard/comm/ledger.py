"""Bytes (and, when timed, seconds) of collectives per (op, group), and always the seconds the calling thread spent in
them (issuing, and waiting for a result not there yet: the *exposed* wait); a :class:`CommContext` holds one."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterator, Optional


@dataclass
class OpTotals:
    calls: int = 0
    bytes: int = 0  # message size: the tensor each rank hands to the collective
    wire_bytes: float = 0.0  # bytes each rank sends under the ring algorithm
    seconds: float = 0.0  # issue to completion, with comms_logger's timing only (it synchronizes)
    # the calling thread's time in the call and in its wait (what overlap did not hide); a measurement, not part of
    # what a ledger entry is: two ledgers of the same work compare equal
    waited: float = field(default=0.0, compare=False)


@dataclass
class CommLedger:
    """Counts bytes per (op, group); with ``comms_logger.debug``, also per (op, group, call site)."""

    totals: dict[tuple[str, str], OpTotals] = field(default_factory=lambda: defaultdict(OpTotals))
    # the same counts split by where each collective was issued (DeepSpeed's debug appends the caller to the op)
    by_caller: dict[tuple[str, str, str], OpTotals] = field(default_factory=lambda: defaultdict(OpTotals))

    def _entries(self, op: str, group: str, caller: Optional[str]) -> Iterator[OpTotals]:
        yield self.totals[(op, group)]
        if caller is not None:
            yield self.by_caller[(op, group, caller)]

    def record(self, op: str, group: str, nbytes: int, wire_bytes: float, caller: Optional[str] = None) -> None:
        for entry in self._entries(op, group, caller):
            entry.calls += 1
            entry.bytes += nbytes
            entry.wire_bytes += wire_bytes

    def add_time(self, op: str, group: str, seconds: float, caller: Optional[str] = None) -> None:
        for entry in self._entries(op, group, caller):
            entry.seconds += seconds

    def add_wait(self, op: str, group: str, seconds: float) -> None:
        self.totals[(op, group)].waited += seconds

    def waited_by_op(self) -> dict[str, float]:
        """The exposed wait per op (all groups)."""
        out: dict[str, float] = defaultdict(float)
        for (op, _), totals in self.totals.items():
            out[op] += totals.waited
        return dict(out)

    def reset(self) -> None:
        self.totals.clear()
        self.by_caller.clear()

    def total_wire_bytes(self) -> float:
        return sum(t.wire_bytes for t in self.totals.values())

    def summary(self) -> dict[tuple[str, str], OpTotals]:
        return {key: OpTotals(**vars(val)) for key, val in self.totals.items()}

    def format(self) -> str:
        header = f"{'op':<16}{'group':<12}{'calls':>8}{'msg MB':>12}{'wire MB':>12}{'time s':>10}"
        lines = [header + f"{'algbw GB/s':>12}{'busbw GB/s':>12}"]
        for (op, group), t in sorted(self.totals.items()):
            lines.append(f"{op:<16}{group:<12}" + _columns(t))
            for (_, _, caller), c in sorted(i for i in self.by_caller.items() if i[0][:2] == (op, group)):
                lines.append(f"{'':<28}" + _columns(c) + f"  issued at {caller}")
        return "\n".join(lines)


def _columns(t: OpTotals) -> str:
    # algorithmic bandwidth: message bytes / time; bus bandwidth: bytes each rank put on the wire / time
    algbw = f"{t.bytes / t.seconds / 1e9:.3f}" if t.seconds else "-"
    busbw = f"{t.wire_bytes / t.seconds / 1e9:.3f}" if t.seconds else "-"
    time_s = f"{t.seconds:.4f}" if t.seconds else "-"
    return f"{t.calls:>8}{t.bytes / 1e6:>12.3f}{t.wire_bytes / 1e6:>12.3f}{time_s:>10}{algbw:>12}{busbw:>12}"
