"""Who the collectives are recorded for: a :class:`CommContext` holds a byte ledger, whether collectives
are timed, and the trace of recent collectives that hang forensics compares across ranks.

Every :class:`~zeroshard.comm.Group` belongs to one context. The process has a default context (groups
built without one, ``zeroshard.comm.log_summary()``); each engine builds its groups in a context of its own
whose parent is the default, so an engine counts exactly its own traffic (two engines in one process stay
apart, and neither resets the other) while the default still counts everything the process sent. The
trace is the root's: forensics compares the sequence of *all* collectives a process issued, since that
is what must agree between ranks.
"""

from __future__ import annotations

from typing import Callable, Optional

from .ledger import CommLedger
from .trace import CollectiveTrace, TraceEntry


class CommContext:
    def __init__(self, parent: Optional["CommContext"] = None):
        self.parent = parent
        self.ledger = CommLedger()
        self.trace = parent.trace if parent is not None else CollectiveTrace()
        self.timing = False  # time every collective (it synchronizes: on for comms_logger only)
        # comms_logger.debug: this context's ledger also splits each op by the call site that issued it
        self.by_caller = False
        # comms_logger.verbose: told of each timed collective of this context as it completes
        # (op, group, message bytes, wire bytes, seconds)
        self.each_op: Optional[Callable[[str, str, int, float, float], None]] = None
        # called before each collective is issued and before it is waited on (a test seam:
        # zeroshard.testing.inject_delays); the nearest context in the chain that sets one decides
        self.pause: Optional[Callable[[], None]] = None
        # called before waiting on a collective with its op and issue time (time.perf_counter()); it may sleep to
        # make the collective take longer from its issue, which compute done meanwhile hides as it would hide a
        # slow link (a test seam: zeroshard.testing.slow_collectives); the nearest context that sets one decides
        self.slow_link: Optional[Callable[[str, float], None]] = None
        # Note [compute-only runs]: nothing leaves the rank; each collective fills its output from this rank's own
        # data, as a group of one would (a benchmark seam: zeroshard.testing.compute_only, the compute-only limit);
        # how many compute_only blocks are open (they nest: leaving an inner one keeps the outer one in effect)
        self.compute_only = 0

    def __repr__(self) -> str:
        return "CommContext(default)" if self.parent is None else "CommContext(child)"

    def _chain(self):
        context = self
        while context is not None:
            yield context
            context = context.parent

    def record(self, op: str, group: str, nbytes: int, wire_bytes: float, shape: tuple, dtype: str) -> TraceEntry:
        """Count one collective in this context and its parents; returns its trace entry."""
        entry = self.trace.record(op, group, shape, dtype)
        for context in self._chain():
            context.ledger.record(op, group, nbytes, wire_bytes, entry.site if context.by_caller else None)
        return entry

    def add_time(self, op: str, group: str, seconds: float, caller: Optional[str] = None) -> None:
        for context in self._chain():
            context.ledger.add_time(op, group, seconds, caller if context.by_caller else None)

    def add_wait(self, op: str, group: str, seconds: float) -> None:
        for context in self._chain():
            context.ledger.add_wait(op, group, seconds)

    def _nearest(self, seam: str):
        """The seam (``pause``, ``slow_link``) the nearest context in the chain sets, or None."""
        return next((getattr(c, seam) for c in self._chain() if getattr(c, seam) is not None), None)

    def before_collective(self) -> None:
        pause = self._nearest("pause")
        if pause is not None:
            pause()

    def local_only(self) -> bool:
        """Whether collectives stay on this rank (Note [compute-only runs]): this context or a parent says so."""
        return any(c.compute_only for c in self._chain())

    def before_wait(self, op: str, issued: float) -> None:
        self.before_collective()
        slow_link = self._nearest("slow_link")
        if slow_link is not None:
            slow_link(op, issued)

    def child(self) -> "CommContext":
        """A context whose counts also go to this one."""
        return CommContext(parent=self)


DEFAULT_CONTEXT = CommContext()
