"""Stage 3 at run time: gather each unit before it runs, free it after (or keep it when it is needed again
soon), prefetch ahead, free after backward.

Hooks only decide *when*, following the schedule the last forward recorded (``schedule.GatherSchedule``); the flat
groups own the gather and free (and the comm layer the collectives). Every rank must run the same units in the same
order (as with FSDP): the gathers are collectives issued from these hooks.

Note [saved views of gathered buffers]: a gathered buffer is drawn from the engine's reusable buffers and may
be another one at the next gather, but autograd keeps views of gathered weights for backward (the transposed
weight of a linear layer, a layer norm's weight). While the model's forward runs, a saved-tensor hook
replaces each such view by its position in its flat group, and backward rebuilds it from the buffer the
group holds then (gathering it first if it was freed). Being entered around the whole forward, these hooks
sit below any that activation checkpointing enters inside it, so checkpointed regions still save nothing.

Note [hooks outside compiled graphs]: dynamo would trace a hook it meets inside compiled code; followed into a gather,
it would trace the collective and read a parameter that is still sharded (an error, not a graph). So every hook the
modules and their outputs call is itself ``torch.compiler.disable`` (a partial of a disabled method, never a lambda
around one, which dynamo would trace up to the call and count as a graph break). ``engine.compile()`` compiles each
unit in place (``runtime/compiling.py``, Note [per-unit compile]): its hooks run eagerly around its compiled forward,
which is one graph, reading parameters gathered by then; a model compiled whole still runs, its graph ending at each
hook. ``ZeroParameter``'s data check is skipped while dynamo traces, for the same reason (``sharded_param.py``).
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any, NamedTuple, Optional, Sequence

import torch
from torch.utils._pytree import tree_flatten

from ..buffers import ReusableBuffers
from ..flat_group import FlatGroup, ParamState
from ..reducer import GradBucket
from .layer_major import Fibers
from .schedule import GatherSchedule
from .units import trigger_modules


class SavedView(NamedTuple):
    """A tensor autograd saved that views a gathered buffer: where in its flat group, not which memory."""

    flat: FlatGroup
    offset: int
    size: torch.Size
    stride: tuple[int, ...]


class GatherUnit:
    """One module's sharded parameters: one flat group per optimizer parameter group, with its gradient bucket,
    and those of the parameters without gradients (``frozen``: one, plus one per storage dtype of packed quantized
    weights). Backward is done with the unit once its buckets
    are complete and, when it holds frozen parameters, once the gradients of its inputs are computed: a frozen
    weight is still needed for those (a LoRA adapter's gradients arrive before its base layer's input gradient)."""

    def __init__(self, name: str, module: torch.nn.Module, buckets: list[GradBucket], frozen: Sequence[FlatGroup] = ()):
        self.name = name or "<root>"
        self.module = module
        self.triggers = trigger_modules(module)  # the module, or for a container the modules inside it that run
        self.buckets = buckets
        self.frozen = list(frozen)
        self.flats = [bucket.flat for bucket in buckets] + self.frozen
        self.numel = sum(f.layout.padded_numel for f in self.flats)
        self.inputs_pending = 0  # input gradients still to come in this backward (units with frozen parameters)

    @property
    def sharded(self) -> bool:
        return all(f.param_state is ParamState.SHARDED for f in self.flats)

    @property
    def grads_complete(self) -> bool:
        return all(b.complete for b in self.buckets)

    @property
    def backward_done(self) -> bool:
        return self.grads_complete and self.inputs_pending == 0


class Stage3Runtime:
    def __init__(
        self,
        root: torch.nn.Module,
        *,
        root_unit: GatherUnit,
        units: list[GatherUnit],
        buffers: ReusableBuffers,
        prefetch_numel: int,
        max_live_numel: int,
        fetch_ahead: int = 0,
        prefetch_depth: int = 1,
        max_reuse_distance: int = 0,
    ):
        self.root_unit = root_unit
        self.units = units  # non-root, pre-order
        self.buffers = buffers
        self._saving: Optional[torch.autograd.graph.saved_tensors_hooks] = None  # see Note [saved views ...]
        self._saving_owner: Optional[torch.nn.Module] = None  # the module whose forward entered them
        self.prefetch_numel = prefetch_numel
        self.prefetch_depth = prefetch_depth  # units gathered ahead at most (stage3_prefetch_depth)
        self.max_live_numel = max_live_numel
        self.max_reuse_distance = max_reuse_distance  # units needed again within this many elements stay gathered
        self.fetch_ahead = fetch_ahead  # offloaded (NVMe) units whose shards are read ahead of their gather
        self.unit_of_flat = {f: u for u in [root_unit, *units] for f in u.flats}
        self.schedule: GatherSchedule[GatherUnit] = GatherSchedule((), self._numel, max_reuse_distance)
        self._recording: list[GatherUnit] = []  # this forward's units so far
        self._on_schedule = False  # whether this forward has run the schedule's units so far
        self._running: list[tuple[GatherUnit, int]] = []  # units inside their forward, with their positions
        self.live_numel = 0
        self.peak_live_numel = 0
        self._gather_seconds = 0.0
        self._backward_hooks: list = []  # on this forward's unit outputs; removed when backward is over
        # Note [layer-major]: the micro-batch forwards running unit by unit, while :meth:`layer_major` is entered;
        # the first one records the units, and a unit is freed (or kept) when the last one leaves it
        self.fibers: Optional[Fibers] = None
        self._positions: dict[int, list[int]] = {}  # id(unit) -> positions the first fiber ran it at, not yet left
        self._paused = False  # a forward on stand-in tensors runs (:meth:`paused`): the hooks do nothing
        self._handles = [
            root.register_forward_pre_hook(self._root_pre_forward),
            root.register_forward_hook(self._root_post_forward, always_call=True),
        ]
        for unit in units:
            for trigger in unit.triggers:
                # partials of the disabled methods, not lambdas: Note [hooks outside compiled graphs]
                pre, post = functools.partial(self._pre_forward, unit), functools.partial(self._post_forward, unit)
                self._handles.append(trigger.register_forward_pre_hook(pre, with_kwargs=True))
                self._handles.append(trigger.register_forward_hook(post, always_call=True))

    def hooked_modules(self) -> list[torch.nn.Module]:
        """The modules whose hooks gather a unit: the root and every unit's triggers (what a compiled region may
        not hold below it: Note [hooks outside compiled graphs])."""
        return [self.root_unit.module, *(trigger for unit in self.units for trigger in unit.triggers)]

    # -- gathering and freeing, with the live-parameter count ------------------------------
    def _gather(self, unit: GatherUnit, async_op: bool) -> None:
        started = time.perf_counter()
        if unit.sharded:
            self.live_numel += unit.numel
            self.peak_live_numel = max(self.peak_live_numel, self.live_numel)
        for flat in unit.flats:
            flat.gather(async_op=async_op)
        self._gather_seconds += time.perf_counter() - started

    def take_gather_seconds(self) -> float:
        """Time spent issuing and waiting for gathers since the last call (for wall_clock_breakdown)."""
        seconds, self._gather_seconds = self._gather_seconds, 0.0
        return seconds

    def _free(self, unit: GatherUnit) -> None:
        if not unit.sharded:
            self.live_numel -= unit.numel
            for flat in unit.flats:
                flat.free()

    def _prefetch(self, candidates: Sequence[GatherUnit]) -> None:
        """Issue gathers for the next units while the prefetch depth and the prefetch and live budgets allow, and
        start reading the shards of the ones after that from NVMe."""
        issued, window = 0, candidates[: self.prefetch_depth]
        beyond = len(window)  # where the gathers stopped
        for index, unit in enumerate(window):
            if not unit.sharded:
                continue  # gathered, or its gather already in flight
            if issued + unit.numel > self.prefetch_numel or self.live_numel + unit.numel > self.max_live_numel:
                beyond = index
                break
            if any(flat.update_pending for flat in unit.flats):
                beyond = index  # the optimizer step running behind has yet to publish it: run this unit meanwhile
                break
            self._gather(unit, async_op=True)
            issued += unit.numel
        for unit in [u for u in candidates[beyond:] if u.sharded][: self.fetch_ahead]:  # disk reads beyond
            for flat in unit.flats:
                flat.fetch()

    # -- forward ---------------------------------------------------------------------------------
    @staticmethod
    def _numel(unit: GatherUnit) -> int:
        return unit.numel

    @torch.compiler.disable  # Note [hooks outside compiled graphs]
    def _root_pre_forward(self, module, args) -> None:
        if self._paused:
            return
        if self.fibers is None:  # a layer-major step started its recording in layer_major()
            self._start_recording()
            self._save_views_by_position()
        self._gather(self.root_unit, async_op=False)

    def _start_recording(self) -> None:
        self._recording, self._running, self._positions = [], [], {}
        self._on_schedule = len(self.schedule) > 0

    def _adopt_recording(self) -> None:
        if self._recording and tuple(self._recording) != self.schedule.order:  # a changed order is picked up
            self.schedule = GatherSchedule(self._recording, self._numel, self.max_reuse_distance)

    @torch.compiler.disable
    def _root_post_forward(self, module, args, output) -> Any:
        if self._paused:
            return output
        if self._saving is not None and self._saving_owner is module:
            self._saving.__exit__(None, None, None)
            self._saving = None
        if self.fibers is None:
            self._adopt_recording()
        if not torch.is_grad_enabled():
            self.release_all()  # no backward follows
        return output

    def gathered_bytes_at_most(self) -> int:
        """The most bytes of gathered parameters a step holds at once, besides the root unit: the live budget
        (``stage3_max_live_parameters``), or every unit if they are fewer."""
        flats = [flat for unit in self.units for flat in unit.flats if not flat.resident]
        numel = min(self.max_live_numel, sum(flat.layout.padded_numel for flat in flats))
        return numel * max((flat.dtype.itemsize for flat in flats), default=0)

    @contextlib.contextmanager
    def paused(self):
        """Hooks that do nothing, for a forward that runs on stand-in parameters (the meta-tensor trace that
        measures a micro-batch's activations before a layer-major step): nothing is gathered, recorded or freed."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    @contextlib.contextmanager
    def layer_major(self, fibers: Fibers):
        """Run the micro-batch forwards that ``fibers`` runs inside, unit by unit (Note [layer-major]): the units'
        order is recorded from the first, the saved-tensor hooks cover all of them, and each unit is freed (or kept
        for its reuse) once the last micro-batch has left it."""
        self._start_recording()
        self.fibers = fibers
        self._saving = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._saving_owner = None  # this context's: no module's post-forward exits it
        self._saving.__enter__()
        try:
            yield
        finally:
            saving, self._saving = self._saving, None
            saving.__exit__(None, None, None)
            self.fibers = None
            self._adopt_recording()

    @torch.compiler.disable
    def _pre_forward(self, unit: GatherUnit, module: torch.nn.Module, args, kwargs) -> None:
        if self._paused:
            return
        if torch._C._current_graph_task_id() != -1:
            self._gather(unit, async_op=False)  # recomputed inside backward (activation checkpointing)
            return
        if self.fibers is not None:
            self.fibers.at_unit()  # the other micro-batches run to here first (Note [layer-major])
        if self._saving is None:
            self._save_views_by_position(module)  # the model's forward did not enter through its root
        if unit.frozen and torch.is_grad_enabled():
            self._watch_inputs(unit, (args, kwargs))
        if self.fibers is not None and not self.fibers.first:
            self._gather(unit, async_op=False)  # gathered by the first micro-batch, unless freed since
            return
        self._recording.append(unit)
        position = len(self._recording) - 1
        self._on_schedule = self._on_schedule and self.schedule.follows(self._recording)
        self._running.append((unit, position))
        self._gather(unit, async_op=False)
        if self._on_schedule:
            self._prefetch(self.schedule.ahead_in_forward(position))

    @torch.compiler.disable
    def _post_forward(self, unit: GatherUnit, module: torch.nn.Module, args, output) -> Any:
        if self._paused:
            return output
        if self._saving is not None and self._saving_owner is module:
            self._saving.__exit__(None, None, None)
            self._saving = None
        if torch._C._current_graph_task_id() != -1:
            return output  # activation checkpointing recomputes inside backward: the unit is still needed
        if self.fibers is None or self.fibers.first:
            position = next((p for u, p in reversed(self._running) if u is unit), None)
            self._running = [(u, p) for u, p in self._running if p != position]
            if self.fibers is not None:
                self._positions.setdefault(id(unit), []).append(position)
        if self.fibers is not None:
            if not self.fibers.last:  # later micro-batches run this unit next: it stays gathered for them
                self._hook_outputs(unit, output)
                return output
            left = self._positions.get(id(unit), [])
            position = left.pop(0) if left else None
        if torch.is_grad_enabled():
            self._hook_outputs(unit, output)
            if position is not None and self._keeps(position):
                return output
        self._free(unit)
        return output

    def _hook_outputs(self, unit: GatherUnit, output) -> None:
        """Gather ``unit`` again when the gradient of one of its outputs arrives in backward."""
        if torch.is_grad_enabled():
            tensors = [t for t in tree_flatten(output)[0] if torch.is_tensor(t) and t.requires_grad]
            for tensor in tensors:
                self._backward_hooks.append(tensor.register_hook(lambda grad, unit=unit: self._pre_backward(unit)))

    def _keeps(self, position: int) -> bool:
        """Whether the unit that ran at ``position`` stays gathered for its next use: the schedule says it is
        reused soon (Note [reuse distance] in schedule.py) and keeping it leaves room within the live budget for
        the next unit's gather."""
        if not self._on_schedule or not self.schedule.keeps(position):
            return False
        following = self.schedule.next_in_forward(position)
        needed = following.numel if following is not None and following.sharded else 0
        return self.live_numel + needed <= self.max_live_numel

    # -- saved views (Note [saved views of gathered buffers]) -----------------------------------------
    def _save_views_by_position(self, owner: Optional[torch.nn.Module] = None) -> None:
        """Enter the saved-tensor hooks for the forward that ``owner`` (default: the root) runs."""
        if torch.is_grad_enabled() and self._saving is None:
            self._saving = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._saving_owner = owner if owner is not None else self.root_unit.module
            self._saving.__enter__()

    def _pack(self, tensor: torch.Tensor) -> Any:
        flat = self.buffers.owner_of(tensor)
        if flat is None:
            return tensor
        return SavedView(flat, tensor.storage_offset(), tensor.size(), tensor.stride())

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, SavedView):
            return saved
        if saved.flat.param_state is not ParamState.GATHERED:
            self._gather(self.unit_of_flat[saved.flat], async_op=False)  # freed since: freed again by release_all
        return saved.flat.buffer.as_strided(saved.size, saved.stride, saved.offset)

    # -- backward --------------------------------------------------------------------------------
    @torch.compiler.disable
    def _pre_backward(self, unit: GatherUnit) -> None:
        if not unit.backward_done:
            self._gather(unit, async_op=False)  # gathers, or waits for a prefetch, or nothing if gathered
            self._prefetch(self.schedule.ahead_in_backward(unit))
        return None

    def _watch_inputs(self, unit: GatherUnit, inputs) -> None:
        """Count the unit's inputs that will receive a gradient; each one's arrival is a step towards the end of
        the unit's backward."""
        tensors = [t for t in tree_flatten(inputs)[0] if torch.is_tensor(t) and t.requires_grad]
        unit.inputs_pending += len(tensors)
        for tensor in tensors:
            self._backward_hooks.append(tensor.register_hook(lambda grad, unit=unit: self._input_grad(unit)))

    def _input_grad(self, unit: GatherUnit) -> None:
        unit.inputs_pending = max(0, unit.inputs_pending - 1)
        self._free_if_done(unit)

    def on_flat_group_complete(self, flat: FlatGroup) -> None:
        """All gradients of a flat group are staged: once its whole unit is done, free the unit."""
        unit = self.unit_of_flat.get(flat)
        if unit is not None:
            self._free_if_done(unit)

    def _free_if_done(self, unit: GatherUnit) -> None:
        if unit is not self.root_unit and unit.backward_done:
            self._free(unit)

    def destroy(self) -> None:
        """Remove the module hooks; nothing stays gathered."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.release_all()

    def begin_backward(self) -> None:
        """Backward is starting: the root unit is gathered (a no-op after this micro-batch's forward, which gathered
        it). It may not be when other forwards ran and a backward freed it since (a pipeline stage's 1F1B order runs
        micro-batch k's backward after k + 1's forward and k - 1's backward); activation checkpointing then
        recomputes modules of the root unit inside backward, where no hook of the root's runs."""
        self._gather(self.root_unit, async_op=False)

    def end_backward(self, graph_retained: bool = False) -> None:
        """The engine's backward is over: nothing stays gathered, and unless the graph is kept for another
        backward, no output tensor keeps a hook (and through it this runtime) alive."""
        if not graph_retained:
            for handle in self._backward_hooks:
                handle.remove()
            self._backward_hooks = []
        self.release_all()

    def release_all(self) -> None:
        """End of backward (or of a no-grad forward): nothing stays gathered."""
        for unit in [self.root_unit, *self.units]:
            unit.inputs_pending = 0
            self._free(unit)


def build_units(plans, buckets: list[GradBucket], frozen: list[FlatGroup] = ()) -> tuple[GatherUnit, list[GatherUnit]]:
    """Attach each non-resident flat group (with its gradient bucket) to the unit whose parameters it holds."""
    unit_of_param = {p: plan for plan in plans for p in plan.params}
    members: dict[str, list[GradBucket]] = {plan.name: [] for plan in plans}
    for bucket in buckets:
        if not bucket.flat.resident:
            members[unit_of_param[bucket.flat.params[0]].name].append(bucket)
    frozen_of: dict[str, list[FlatGroup]] = {plan.name: [] for plan in plans}
    for flat in frozen:
        frozen_of[unit_of_param[flat.params[0]].name].append(flat)
    units = [GatherUnit(plan.name, plan.module, members[plan.name], frozen_of[plan.name]) for plan in plans]
    return units[0], [u for u in units[1:] if u.flats]
