"""A step's micro-batches run unit by unit (``zero_optimization.layer_major``, ``engine.train_batch``).

Note [layer-major]: with gradient accumulation, stage 3 gathers every unit once per micro-batch in forward and again
in backward, and reads every NVMe shard as often. Run layer-major, each unit runs every micro-batch of the step
before the next unit is gathered, so it is gathered once in forward and once in backward per step.

The model's forward is arbitrary code, so it cannot be cut into units from outside. Instead each micro-batch's
forward runs as a *fiber* (a greenlet: a stack of its own on this thread) and gives the turn back at the start of
every unit (``Stage3Runtime``'s pre-forward hook calls :meth:`Fibers.at_unit`); the scheduler runs the fibers round
robin, so all of them pass unit ``u`` before any enters ``u + 1``, and the unit stays gathered until the last one has
run it. Backward is one ``backward()`` of the micro-batches' scaled losses summed in order. It runs unit by unit in
reverse as well, for a reason worth knowing: autograd runs the ready nodes with the highest sequence number first,
and sequence numbers count per thread, in creation order. Greenlets share their thread, so the nodes were numbered
layer-major and backward visits them in the reverse order (measured: threads instead number each micro-batch apart,
and backward then runs micro-batch by micro-batch). Each parameter's gradient arrives once, the sum over the
micro-batches (autograd adds them in its input buffer, the last micro-batch's first), so each unit is reduce-scattered
once per step. That sum is in another order than the micro-batch loop's (a reduce-scatter per micro-batch, added in
micro-batch order): equal within float rounding, not bit for bit.

The price is memory: every micro-batch's activations are alive together when backward starts. The engine measures
a step before running it (``runtime/activation_fit.py``) and refuses one that does not fit, on every rank.

Greenlets share their thread's state, and torch keeps some of it per thread: whether gradients are enabled, whether
autocast is on (and to which dtype), and the stack of saved-tensor hooks (activation checkpointing pushes its own
around each checkpointed region, which a fiber may leave at a unit's start). A fiber that gives the turn back takes
its part of that state with it and puts it back when it resumes (:class:`_ParkedState`), so each fiber sees only its
own.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import greenlet
import torch

_top_hooks = torch._C._autograd._top_saved_tensors_default_hooks
_push_hooks = torch._C._autograd._push_saved_tensors_default_hooks
_pop_hooks = torch._C._autograd._pop_saved_tensors_default_hooks


class Fibers:
    """Micro-batch forwards as greenlets of this thread, switched round robin at each gather unit's start."""

    def __init__(self) -> None:
        self.index: Optional[int] = None  # the fiber running now (None: the scheduler)
        self._live: list[int] = []
        self._scheduler: Optional[greenlet.greenlet] = None
        self.failed: Optional[int] = None  # the micro-batch whose forward raised
        self._base: Optional[_ParkedState] = None  # the scheduler's thread state, which every fiber starts from

    @property
    def first(self) -> bool:
        """The running fiber is the first micro-batch (its forward decides the unit order recorded)."""
        return self.index == 0

    @property
    def last(self) -> bool:
        """No fiber after the running one in this round: the units it leaves are done with for the step."""
        return bool(self._live) and self.index == self._live[-1]

    def run(self, calls: list[Callable[[], Any]]) -> list[Any]:
        """Run ``calls`` (each a micro-batch's forward) to their ends, round robin between unit starts; their
        results in order. A failure in one is raised here, and the others are ended."""
        self._scheduler = greenlet.getcurrent()
        self._base = _ParkedState.of_scheduler()
        results: list[Any] = [None] * len(calls)

        def body(k: int, call: Callable[[], Any]) -> None:
            try:
                results[k] = call()
            except greenlet.GreenletExit:
                raise  # ended by the scheduler after another one failed
            except BaseException:
                self.failed = k
                raise

        fibers = [greenlet.greenlet(lambda k=k, call=call: body(k, call)) for k, call in enumerate(calls)]
        self._live = list(range(len(calls)))
        try:
            while self._live:
                for k in list(self._live):
                    self.index = k
                    fibers[k].switch()
                    if fibers[k].dead:
                        self._live.remove(k)
        finally:
            self.index, self._live = None, []
            for fiber in fibers:
                if fiber and not fiber.dead:
                    fiber.throw(greenlet.GreenletExit)  # its context managers exit, in its own stack
            self._scheduler = None
        return results

    def at_unit(self) -> None:
        """A fiber reached a unit's start: the others run to the same point before it goes on."""
        if self._scheduler is not None and self.index is not None and greenlet.getcurrent() is not self._scheduler:
            parked = _ParkedState.park(self._base)
            self._scheduler.switch()
            parked.restore()


class _ParkedState:
    """A fiber's share of its thread's torch state while it waits: its grad mode, its autocast settings (a forward
    may enter ``torch.autocast`` around several units, and its exit restores what it found on entry), and the
    saved-tensor hooks it pushed above the scheduler's."""

    def __init__(self, grad_enabled: bool, autocast: tuple, hooks: list, base_pack: Any):
        self.grad_enabled, self.autocast, self.hooks, self.base_pack = grad_enabled, autocast, hooks, base_pack

    @classmethod
    def of_scheduler(cls) -> "_ParkedState":
        top = _top_hooks(False)
        return cls(torch.is_grad_enabled(), _autocast_state(), [], top[0] if top is not None else None)

    @classmethod
    def park(cls, base: "_ParkedState") -> "_ParkedState":
        """Take the running fiber's state off the thread, leaving the scheduler's."""
        hooks = []
        while (top := _top_hooks(False)) is not None and top[0] is not base.base_pack:
            hooks.append(top)
            _pop_hooks()
        parked = cls(torch.is_grad_enabled(), _autocast_state(), hooks[::-1], base.base_pack)
        torch._C._set_grad_enabled(base.grad_enabled)
        _set_autocast_state(base.autocast)
        return parked

    def restore(self) -> None:
        for pack, unpack in self.hooks:
            _push_hooks(pack, unpack)
        torch._C._set_grad_enabled(self.grad_enabled)
        _set_autocast_state(self.autocast)


_AUTOCAST_DEVICES = ("cpu", "cuda")


def _autocast_state() -> tuple:
    return tuple((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES)


def _set_autocast_state(state: tuple) -> None:
    for device, (enabled, dtype) in zip(_AUTOCAST_DEVICES, state):
        torch.set_autocast_enabled(device, enabled)
        torch.set_autocast_dtype(device, dtype)
