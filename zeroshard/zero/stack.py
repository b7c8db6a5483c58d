"""The ZeRO stack: the one owner of a rank's model state for one engine, and the step over it.

It holds every object :func:`~zeroshard.zero.assemble.build_zero_stack` built, in the order it built them: the
parameter records, the reusable buffers, the flat groups (trainable, then stage 3's frozen ones), the optimizer
state in its home, the gradient reducer with one bucket per flat group, the gradient exchange (exact, or a 1-bit
optimizer's compressed one: :mod:`.exchange`), the loss scaler, the stage-3 runtime, the offload homes, the host
copies of offloaded states and the per-parameter access. The engine drives it: ``begin_backward`` /
``end_backward`` around the user's backward, ``step``, ``zero_grad``; checkpoints read and write it per flat group
(the ``ShardedOptimizer`` protocol of ``checkpoint/view.py``). Clients see its optimizer through
:class:`~zeroshard.zero.optimizer.ZeroOptimizer`, a ``torch.optim.Optimizer`` view of it that ``initialize`` makes
and the engine holds.

The step's arithmetic: the global gradient norm (one all-reduce of partial squares: over the shard group, then the
tensor-sharded flat groups' part over the tensor group), fp16 overflow and the loss scale, clipping in the same
multiply as unscaling, the exchange's transform, then the optimizer state steps and publishes. With an offloaded
optimizer at stage 3 that last part runs behind the next forward (:mod:`.step_behind`): the verdict and the
coefficient are this thread's, the update the worker's; the next backward, step, checkpoint and every other use of
the state wait for it (:meth:`ZeroStack.settle`). An offloaded optimizer can also step during backward, before the
verdict, into shadow slots (:mod:`.speculation`): the verdict then commits those steps, or discards them and the
step runs as above.

An engine without an optimizer holds a stack with no flat groups (:meth:`ZeroStack.without_optimizer`), whose
training calls say what is missing.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch

from .. import comm
from ..offload import IOStats, ShardHomes
from ..optim import update_rule
from ..optim.contract import needs_of
from ..precision import LossScaler
from .buffers import ReusableBuffers
from .exchange import ExactExchange
from .flat_group import FlatGroup
from .grad_norm import GradientNorm, NormAxes
from .optimizer_state import OptimizerState
from .param_access import ParamAccess
from .reducer import GradientReducer
from .sharded_param import ParamRecords
from .speculation import SpeculationStats, would_commit
from .stage3 import Stage3Runtime
from .state_offload import COMPUTE, TRAINING, StateOffload

ROLES = (
    "params",
    "gathered",
    "master",
    "grad_shard",
    "staging",
    "idle_buffers",
    "optimizer_state",
    "compression_error",
)
NO_OPTIMIZER = "needs an optimizer: pass optimizer= or add an 'optimizer' config block"


@dataclass(frozen=True)
class StepSettings:
    """The config's numbers for the step: ``gradient_clipping`` (0: off) and ``max_consecutive_skipped_steps``."""

    gradient_clipping: float = 0.0
    max_consecutive_skipped_steps: int = 0


class NonFiniteGradientError(RuntimeError):
    """Gradients were inf/nan for too many optimizer steps in a row with no loss scale to recover them."""


class ZeroStack:
    """One engine's ZeRO state, its owner and the calls that drive it (see the module docstring)."""

    def __init__(
        self,
        *,
        records: ParamRecords,
        buffers: ReusableBuffers,
        flat_groups: list[FlatGroup],
        frozen_groups: list[FlatGroup],
        optimizer_state: OptimizerState,
        reducer: GradientReducer,
        exchange: ExactExchange,
        loss_scaler: LossScaler,
        norm: NormAxes,
        settings: StepSettings,
        stage3: Optional[Stage3Runtime] = None,
        shard_homes: Optional[ShardHomes] = None,
        ties: Optional[list[Optional[comm.Group]]] = None,
    ):
        self.records = records  # what is known of each parameter
        self.buffers = buffers  # gathered units and gradient staging, reused step after step
        self.flat_groups = flat_groups  # trainable, in reduction order (the optimizer state steps them)
        self.frozen_groups = frozen_groups  # stage 3: sharded parameters without gradients (never stepped)
        self.optimizer_state = optimizer_state  # master weights and the optimizer's state, in their home
        self.reducer = reducer  # gradient hooks, one bucket per flat group, the reductions
        self.exchange = exchange  # how the reduced (or each rank's own) gradients become the update's input
        self.loss_scaler = loss_scaler
        self.norm, self.settings = norm, settings
        self.stage3 = stage3
        self.shard_homes = shard_homes  # offload_param: where stage-3 shards live, and their staging pool
        device = buffers.device  # the compute device, also where a rank without trainable parameters has none
        self.states = StateOffload(  # the host copies while offload_states has the device storages freed
            flat_groups + frozen_groups, optimizer_state, reducer.buckets, buffers, device
        )
        self.access = ParamAccess(records, optimizer_state, reducer, self.states)  # one parameter's state
        # the global norm, and what pipeline stages share
        self.gradient_norm = GradientNorm(flat_groups, norm, device, ties)
        self._ties_summed = False  # sum_tied_gradients ran since the last step
        self.consecutive_skipped = 0
        self.steps_taken = 0  # optimizer steps attempted (applied or skipped)
        self.overflow = False  # DeepSpeed's name: whether the last step was skipped for non-finite gradients
        self.global_grad_norm: Optional[float] = None
        self.exchange.choose_reduction(self.steps_taken)
        # the offloaded step runs behind the next forward where nothing in it is a collective (see step_behind):
        # an elementwise optimizer's (norms or whole matrices are collectives, optim.contract) whose exchange is
        # done when backward is
        local = not exchange.step_communicates and needs_of(optimizer_state.optimizer).elementwise
        self.steps_behind = stage3 is not None and local and optimizer_state.can_step_behind
        if optimizer_state.speculation is not None:  # tied gradients are summed over the stages after backward
            optimizer_state.speculation.excluded.update(k for k, tie in enumerate(ties or []) if tie is not None)

    def settle(self) -> None:
        """Wait for an optimizer step running behind the forward (raising its error, if it failed)."""
        self.optimizer_state.settle()

    @classmethod
    def without_optimizer(cls, device: torch.device) -> "NoOptimizerStack":
        """An engine built without an optimizer (evaluation, ``init_inference``-like use): nothing is sharded."""
        return NoOptimizerStack(device)

    def refuse_if_offloaded(self, call: str, weights_only: bool = False) -> None:
        """Refuse ``call`` by name while a state it needs is on the host (``weights_only``: it reads the compute
        parameters and nothing else, as a forward does)."""
        self.states.refuse_use(f"engine.{call}", COMPUTE if weights_only else TRAINING)

    def needs_optimizer(self, call: str) -> "ZeroStack":
        return self

    # -- one training step -------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale

    def begin_backward(self, boundary: bool, scaled_loss: Optional[torch.Tensor]) -> None:
        """Before the user's backward: whether it ends an accumulation, and the loss autograd starts from (None:
        autograd starts from several inside nodes, a zero-bubble schedule's weight pass)."""
        self.settle()  # the gradients it accumulates into are the previous step's until that step is done
        if boundary:  # the step's last micro-batch: its final gradients may be stepped as they come
            self.optimizer_state.arm_speculation(self.loss_scaler.scale)
        self.reducer.begin_backward(boundary, scaled_loss)
        if self.stage3 is not None:
            self.stage3.begin_backward()

    def end_backward(self, graph_retained: bool = False) -> None:
        """After it: the remaining reductions are launched and finished, then (stage 3) what is still gathered is
        freed (the hooks on this forward's outputs stay only when the graph is kept for another backward)."""
        self.reducer.end_backward()
        if self.stage3 is not None:
            self.stage3.end_backward(graph_retained=graph_retained)

    def sum_tied_gradients(self) -> None:
        """Sum the reduced gradients of parameters tied across pipeline stages over those stages, once per step
        (a pipeline schedule's ``ReduceTiedGrads``, else the step itself)."""
        if not self._ties_summed:
            self.settle()
            self.reducer.verify_gradients(self.steps_taken + 1)  # the reduction's check, before the ties add to them
            self.gradient_norm.sum_tied(self.reducer.grads)
            self._ties_summed = True

    def step(self) -> bool:
        """Unscale, clip and apply the reduced gradients; False when an fp16 overflow skipped the step."""
        self.settle()
        scale = self.loss_scaler.scale
        grads = self.reducer.grads  # where each shard waits: in memory, or on disk (NVMe optimizer offload)
        self.sum_tied_gradients()
        self._ties_summed = False  # this step consumes them
        average_over = self.reducer.gradient_group if self.exchange.averages_itself() else None
        norm = math.sqrt(self.gradient_norm.squared(grads, average_over).item()) / scale
        overflow = self.overflow = not math.isfinite(norm)
        self.global_grad_norm = math.inf if overflow else norm  # NaN gradients report inf too, as DeepSpeed's
        clip = self.settings.gradient_clipping
        # what was stepped during backward is committed only if this step applies it as it was computed
        committed = self.optimizer_state.resolve_speculation(would_commit(norm, clip), scale)
        self.steps_taken += 1
        self.loss_scaler.update(overflow)
        if overflow:
            self.consecutive_skipped += 1
            limit = self.settings.max_consecutive_skipped_steps
            if not self.loss_scaler.dynamic and limit and self.consecutive_skipped >= limit:
                raise NonFiniteGradientError(
                    f"optimizer step {self.steps_taken}: gradients were non-finite for {self.consecutive_skipped} "
                    f"steps in a row (every one skipped), first at parameter '{self._first_non_finite()}'; "
                    "check the loss and the data for inf/nan, lower the learning rate, or raise "
                    "max_consecutive_skipped_steps (0 never stops)"
                )
            self.reducer.zero_grad()
            self.exchange.choose_reduction(self.steps_taken)
            return False
        self.consecutive_skipped = 0
        coef = 1.0 / scale
        if clip > 0 and norm > clip:
            coef *= clip / (norm + 1e-6)
        grads, coef = self.exchange.transform(grads, coef, lambda index: self.read_flat(index).get("exp_avg"))
        for index in committed:
            self.optimizer_state.commit(index)
        rest = [index for index in range(len(self.flat_groups)) if index not in committed]
        if self.steps_behind and rest:
            label = f"optimizer step {self.steps_taken}"
            order = [index for index in self._forward_order() if index not in committed]
            self.optimizer_state.step_behind(grads, coef, order, self.reducer.zero_grad, label)
        else:
            if committed:
                self.optimizer_state.step(grads, coef, rest)  # an offloaded home: the flat groups not speculated
            else:
                self.optimizer_state.step(grads, coef)
            self.reducer.zero_grad()
        self.exchange.choose_reduction(self.steps_taken)
        return True

    def _forward_order(self) -> list[int]:
        """The trainable flat groups in the order the forward gathers them (the root unit's, then the units' as
        the last forward ran them), then any the forward did not reach."""
        index = {id(flat): k for k, flat in enumerate(self.flat_groups)}
        order: list[int] = []
        for unit in [self.stage3.root_unit, *self.stage3.schedule.order]:
            order.extend(k for b in unit.buckets if (k := index.get(id(b.flat))) is not None and k not in order)
        return order + [k for k in range(len(self.flat_groups)) if k not in order]

    def _first_non_finite(self) -> str:
        """The first parameter, in flat-group order over all ranks' shards, with a non-finite gradient."""
        big = len(self.flat_groups) * (1 << 40)
        first = torch.tensor([big], dtype=torch.int64)
        for index, (flat, bucket) in enumerate(zip(self.flat_groups, self.reducer.buckets)):
            bad = (~torch.isfinite(bucket.grad)).nonzero()
            if bad.numel():
                lo = 0 if bucket.holds_whole else flat.layout.shard_range(flat.shard_rank)[0]
                first[0] = index * (1 << 40) + lo + int(bad[0, 0])
                break
        if self.norm.shard is not None:
            comm.all_reduce(first, self.norm.shard, op="min")
        index, offset = divmod(int(first.item()), 1 << 40)
        if index >= len(self.flat_groups):
            return "?"
        slot = next((s for s in self.flat_groups[index].layout.slots if s.offset <= offset < s.end), None)
        return slot.name if slot is not None else "?"

    def zero_grad(self, module: Optional[torch.nn.Module] = None) -> None:
        if self.optimizer_state.stepping_behind:
            return  # the step running behind clears the gradients once it has used them
        self.optimizer_state.abandon_speculation()  # steps speculated from the gradients cleared now
        self.reducer.zero_grad()

    def learning_rates(self) -> list[float]:
        return [group["lr"] for group in self.param_groups]

    def take_gather_seconds(self) -> float:
        """Time spent gathering stage-3 units since the last call (0 without stage 3)."""
        return self.stage3.take_gather_seconds() if self.stage3 is not None else 0.0

    def destroy(self) -> None:
        """Finish the reductions in flight and a step running behind, and remove the gradient and stage-3 module
        hooks."""
        self.optimizer_state.close()
        self.reducer.destroy()
        if self.stage3 is not None:
            self.stage3.destroy()

    # -- states off the device and back (DeepSpeed's offload_states / reload_states) ------------------
    def offload_states(
        self, include=None, device: Any = "cpu", pin_memory: bool = True, non_blocking: bool = False
    ) -> None:
        """Move the states in ``include`` (DeepSpeed's ``OffloadStateTypeEnum`` values; all when None) to host
        memory, freeing the compute device (see :mod:`.state_offload`); the engine refuses to train until
        :meth:`reload_states`. Only ``device="cpu"``; ``"none"`` does nothing, as in DeepSpeed."""
        self.settle()  # a step running behind writes these states
        device = getattr(device, "value", device)
        if device == "none":
            logging.getLogger("zeroshard").warning("offload_states(device='none'): nothing to do")
            return
        if device != "cpu":
            raise ValueError(f"offload_states(device={device!r}): only 'cpu' is supported (as in DeepSpeed)")
        if any(flat.home is not None for flat in self.states.flats):
            raise NotImplementedError(
                "offload_states with zero_optimization.offload_param: the parameters already live off the device"
            )
        self.states.offload(include, pin_memory, non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Bring back what :meth:`offload_states` moved, bit for bit."""
        self.states.reload(non_blocking)

    # -- per-flat-group state, for checkpoints (``zeroshard.checkpoint.view.ShardedOptimizer``) ----------
    @property
    def kind(self) -> str:
        """The update rule, as a checkpoint records it (``optim.update_rule``)."""
        return update_rule(self.optimizer_state.optimizer)

    @property
    def param_groups(self) -> list[dict]:
        """The optimizer's parameter groups (hyperparameters; their params are the master shards)."""
        return self.optimizer_state.optimizer.param_groups

    @property
    def master_dtype(self) -> torch.dtype:
        return self.optimizer_state.master_dtype

    @property
    def state_device(self) -> torch.device:
        return self.optimizer_state.device

    def flat_param_group(self, index: int) -> int:
        """The optimizer parameter group of flat group ``index``."""
        return self.optimizer_state.group_of_flat[index]

    def flat_state_keys(self, index: int) -> list[str]:
        return self.optimizer_state.state_keys(index)

    def flat_scalars(self, index: int) -> dict:
        return self.optimizer_state.scalars(index)

    def read_flat(self, index: int) -> dict[str, torch.Tensor]:
        """One flat group's master shard and optimizer state; while offloaded, read from the host copies."""
        return {key: self.states.readable(t) for key, t in self.optimizer_state.read_flat(index).items()}

    def read_frozen(self, index: int) -> torch.Tensor:
        """A frozen flat group's shard (its only copy), read like :meth:`read_flat`."""
        return self.states.readable(self.frozen_groups[index].shard_values())

    def write_flat(self, index: int, tensors: dict[str, torch.Tensor], scalars: dict) -> None:
        self.optimizer_state.write_flat(index, tensors, scalars)

    def publish(self) -> None:
        """Copy the master weights into the compute parameters (after they were replaced, e.g. by a load); a
        1-bit optimizer forgets its compression state and resumes in the phase its loaded step count says."""
        self.optimizer_state.publish()
        self.exchange.reset()
        self.exchange.choose_reduction(self.steps_taken)

    def compression_state(self) -> dict[str, torch.Tensor]:
        """This rank's 1-bit compression state (errors, the gathered momentum), for a checkpoint; {} otherwise."""
        return self.exchange.state_tensors()

    def load_compression_state(self, tensors: dict[str, torch.Tensor]) -> bool:
        """After :meth:`publish`: restore a checkpoint's compression state when it fits this layout exactly (a
        resume in the compressed phase is then bit-identical); returns whether it did."""
        return self.exchange.load_state_tensors(tensors)

    # -- what it holds ------------------------------------------------------------------------
    @property
    def all_flat_groups(self) -> list[FlatGroup]:
        return [*self.flat_groups, *self.frozen_groups]

    def state_bytes_by_location(self) -> dict[str, dict[str, int]]:
        """Bytes of model state this rank holds per location (``device``, ``host``, ``nvme``) and role, counted
        from the owners' tensors (and swap-file regions)."""
        totals = {where: dict.fromkeys(ROLES, 0) for where in ("device", "host", "nvme")}
        parts = [flat.bytes_held() for flat in self.all_flat_groups]
        parts.append(self.reducer.bytes_held())
        parts.append(self.optimizer_state.bytes_held())
        parts.append({"compression_error": {"device": self.exchange.nbytes()}})
        if self.shard_homes is not None:
            parts.append(self.shard_homes.bytes_held())
        for part in parts:
            for role, places in part.items():
                for where, nbytes in places.items():
                    totals[where][role] += nbytes
        totals["device"]["idle_buffers"] += self.buffers.idle_bytes  # reusable, not in use between steps
        return totals

    def disk_io(self) -> dict[str, float]:
        """Bytes the swap files (optimizer state, stage-3 parameter shards) read and wrote, the seconds the training
        thread waited for them (``wait_s``) and for steps running behind the forward (``behind_wait_s``); counted so
        far, a step still running included (:meth:`settle` first for a whole one). With the step during backward
        (:mod:`.speculation`) also the sub-groups it ``speculated``, ``committed`` and ``replayed``, the bytes of
        state the replays stepped again (``replay_bytes``), the same for the last step (``last_*``), and the
        training thread's wait for it at the verdict (``speculation_wait_s``)."""
        total = IOStats()
        for file in self.optimizer_state.swap_files() + (self.shard_homes.swap_files() if self.shard_homes else []):
            total = total.add(file.stats)
        behind, speculation = self.optimizer_state.behind, self.optimizer_state.speculation
        return {
            **asdict(total),
            "behind_wait_s": behind.waited_s if behind is not None else 0.0,
            **speculation_counts(speculation.stats if speculation is not None else None),
        }

    def state_bytes(self) -> dict[str, int]:
        """Bytes of model state this rank holds per role, wherever it lives."""
        by_location = self.state_bytes_by_location()
        return {role: sum(places[role] for places in by_location.values()) for role in ROLES}


class NoOptimizerStack:
    """The stack of an engine built without an optimizer: no flat groups, nothing sharded or reduced; its
    training calls say what is missing, the rest answers as an empty stack."""

    def __init__(self, device: torch.device):
        self.records = ParamRecords()
        self.buffers = ReusableBuffers(device)
        self.flat_groups: list[FlatGroup] = []
        self.frozen_groups: list[FlatGroup] = []
        self.all_flat_groups: list[FlatGroup] = []
        self.access = self.stage3 = self.reducer = None
        self.global_grad_norm: Optional[float] = None
        self.loss_scale = 1.0

    def needs_optimizer(self, call: str):
        raise RuntimeError(f"engine.{call} {NO_OPTIMIZER}")

    def refuse_if_offloaded(self, call: str, weights_only: bool = False) -> None:
        """Nothing is ever offloaded without an optimizer."""

    def begin_backward(self, boundary: bool, scaled_loss: torch.Tensor) -> None:
        self.needs_optimizer("backward")

    def sum_tied_gradients(self) -> None:
        self.needs_optimizer("step")

    def step(self) -> bool:
        self.needs_optimizer("step")

    def zero_grad(self, module: Optional[torch.nn.Module] = None) -> None:
        if module is not None:
            module.zero_grad(set_to_none=True)

    def learning_rates(self) -> list[float]:
        return []

    def take_gather_seconds(self) -> float:
        return 0.0

    def destroy(self) -> None:
        """Nothing to release."""

    def state_bytes_by_location(self) -> dict[str, dict[str, int]]:
        return {where: dict.fromkeys(ROLES, 0) for where in ("device", "host", "nvme")}

    def state_bytes(self) -> dict[str, int]:
        return dict.fromkeys(ROLES, 0)

    def disk_io(self) -> dict[str, float]:
        return {**asdict(IOStats()), "behind_wait_s": 0.0, **speculation_counts(None)}

    def settle(self) -> None:
        pass


def speculation_counts(stats: Optional[SpeculationStats]) -> dict[str, float]:
    """The step during backward's counts as ``disk_io`` reports them (zeros without it)."""
    counts = asdict(stats if stats is not None else SpeculationStats())
    counts["speculation_wait_s"] = counts.pop("wait_s")
    return counts
