"""How the ranks' gradients become the update's input: one strategy object per ZeRO stack (Note [1-bit reduction]
in ``docs/design.md``).

- :class:`ExactExchange`: the reducer sums and averages every gradient exactly (reduce-scatter, or all-reduce at
  stage 0); the step uses the reduced shards as they are. Every optimizer but the 1-bit ones.
- :class:`QuantizedExchange`: ZeRO++ qgZ (``zero_quantized_gradients``, stage 3): as the exact one, but each rank
  sends its chunks block-quantized (int4) and the owner sums the decompressed ones in fp32, so each chunk is rounded
  once: close to the exact sum, not equal to it.
- :class:`MomentumExchange`: 1-bit Adam, at every stage. Exact during the warm-up; afterwards the reducer keeps each
  rank's own whole gradient and the momentum is averaged 1-bit compressed over the shard layout
  (:mod:`.onebit_momentum`), which turns the gradients into the shards that take the optimizer's momentum to the
  averaged one.
- :class:`OptimizerAveragedExchange`: 0/1 Adam and 1-bit LAMB, at stage 0 only. Exact while the optimizer asks for
  averaged gradients; otherwise each rank keeps its own and the optimizer averages what it needs through the
  compressed all-reduce of the layout it was given (``ShardLayout.compressed``).

The optimizer declares its exchange (``zero_needs.gradient_exchange``, :mod:`zeroshard.optim.contract`: ``"exact"``
unless it says otherwise), so nothing in ``zero/`` asks which optimizer family it holds; the config's
``zero_quantized_gradients`` turns the exact one into the quantized one (a 1-bit optimizer, which compresses its
own exchange, is refused with it). The exchange owns the
reduction mode, the whole-gradient holding that comes with it, the group the norm of unreduced gradients is averaged
over, the post-norm transform, the compression state (checkpointed per rank) and the step at which compression
began.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

from .. import comm
from ..comm.compression import Codec
from ..optim.contract import needs_of
from .flat_group import FlatGroup
from .grad_home import GradHome, ResidentGrad
from .onebit_momentum import OneBitMomentum
from .reducer import GradientReducer, Reduction

ReadExpAvg = Callable[[int], Optional[torch.Tensor]]  # flat group index -> its optimizer momentum shard


class ExactExchange:
    """Every gradient reduced exactly (see the module)."""

    describe = "exact"  # what the compressed phase does, for the line that announces it
    summed = Reduction.EXACT  # how the gradients are summed when they are (the warm-up of the 1-bit ones)
    step_communicates = False  # whether the step itself runs collectives (a 1-bit exchange's transform does)

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        flats: list[FlatGroup],
        reducer: GradientReducer,
        group_of_flat: list[int],
    ):
        self.optimizer, self.flats, self.reducer = optimizer, flats, reducer
        self.group_of_flat = group_of_flat  # the optimizer parameter group of each flat group
        self.compressed_from: Optional[int] = None  # the first global step of the compressed phase

    def averages_itself(self) -> bool:
        """Whether this step's gradients are each rank's own (the norm is then averaged over the ranks)."""
        return self.reducer.reduction is Reduction.LOCAL

    def transform(self, grads: list[GradHome], coef: float, read_exp_avg: ReadExpAvg) -> tuple[list[GradHome], float]:
        """The gradients (times ``coef``) the optimizer state steps with, after the norm and clipping."""
        return grads, coef

    def choose_reduction(self, steps_taken: int) -> None:
        """Set the reducer's mode for the next backward; note the step compression begins at."""
        before = self.reducer.reduction
        self.reducer.reduction = self.summed if self._exact_next() else Reduction.LOCAL
        if before is not Reduction.LOCAL and self.reducer.reduction is Reduction.LOCAL and self.compressed_from is None:
            self.compressed_from = steps_taken + 1  # a global step: skipped steps count, unlike the optimizer's
            if comm.get_rank() == 0:  # zeroshard's logger (zeroshard.log formats it)
                logging.getLogger("zeroshard").info(
                    f"{type(self.optimizer).__name__}: exact warm-up done after {self.optimizer.steps_taken()} "
                    f"updates; from global step {self.compressed_from}: {self.describe}"
                )

    def _exact_next(self) -> bool:
        return True

    def reset(self) -> None:
        """Forget the compression state (after a load: it is per rank and layout)."""

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> bool:
        return False

    def nbytes(self) -> int:
        return 0


class QuantizedExchange(ExactExchange):
    """ZeRO++ qgZ: every gradient reduce-scattered as block-quantized chunks with ``codec`` (see the module)."""

    summed = Reduction.QUANTIZED

    def __init__(self, optimizer, flats, reducer, group_of_flat, codec: Codec):
        super().__init__(optimizer, flats, reducer, group_of_flat)
        reducer.codec = codec  # what the reducer's quantized reduction sends (choose_reduction selects it)


class _Compressed(ExactExchange):
    """What both 1-bit exchanges share: one flat layout without hybrid replicas, and the optimizer's warm-up."""

    step_communicates = True

    def __init__(self, optimizer, flats, reducer, group_of_flat):
        super().__init__(optimizer, flats, reducer, group_of_flat)
        if any(bucket.replica_group is not None and bucket.replica_group.size > 1 for bucket in reducer.buckets):
            raise NotImplementedError(
                f"optimizer {type(optimizer).__name__} with hybrid sharding (zero_hpz_partition_size / "
                "mics_shard_size): the replica groups' reduction would not be compressed; drop one of the two"
            )

    def _exact_next(self) -> bool:
        return self.optimizer.needs_averaged_gradients()

    def reset(self) -> None:
        self.optimizer.reset_compression()

    def nbytes(self) -> int:
        return self.optimizer.compression_bytes()


class MomentumExchange(_Compressed):
    """1-bit Adam's momentum averaged 1-bit compressed over the shard layout, at every stage (see the module)."""

    describe = "each rank's own gradients; the momentum exchanged 1-bit compressed over the shard layout"

    def __init__(self, optimizer, flats, reducer, group_of_flat):
        super().__init__(optimizer, flats, reducer, group_of_flat)
        self.momentum = OneBitMomentum(flats)  # the compression errors and the gathered momentum

    def transform(self, grads, coef, read_exp_avg):
        if self.reducer.reduction is not Reduction.LOCAL:
            return grads, coef
        shards = []
        for index, grad in enumerate(grads):
            beta1 = self.optimizer.param_groups[self.group_of_flat[index]]["betas"][0]
            exp_avg = read_exp_avg(index) if self.momentum.needs_exp_avg(index) else None
            shard = self.momentum.exchange(index, grad.read(), coef, beta1, exp_avg)
            shards.append(ResidentGrad(shard, "device"))
        return shards, 1.0

    def reset(self) -> None:
        self.momentum.reset()
        super().reset()

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return self.momentum.state_tensors()

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> bool:
        return self.momentum.load_state_tensors(tensors)

    def nbytes(self) -> int:
        return self.momentum.nbytes() + super().nbytes()


class OptimizerAveragedExchange(_Compressed):
    """0/1 Adam and 1-bit LAMB at stage 0: the optimizer averages, compressed, through the all-reduce this exchange
    owns (see the module)."""

    describe = "each rank's own gradients, the optimizer averaging 1-bit compressed"

    def __init__(self, optimizer, flats, reducer, group_of_flat):
        super().__init__(optimizer, flats, reducer, group_of_flat)
        if flats and flats[0].shard_group.size > 1 and optimizer.all_reduce is None:
            raise NotImplementedError(
                f"optimizer {type(optimizer).__name__} has no compressed all-reduce to average with: it gets one when "
                "built over the master weights on the device (zero_optimization.offload_optimizer is not supported)"
            )


EXCHANGES = {"exact": ExactExchange, "momentum": MomentumExchange, "optimizer_averaged": OptimizerAveragedExchange}


def exchange_for(
    optimizer: torch.optim.Optimizer,
    flats: list[FlatGroup],
    reducer: GradientReducer,
    group_of_flat: list[int],
    quantized: Optional[Codec] = None,
) -> ExactExchange:
    """The exchange ``optimizer`` declares (``zeroshard.optim.contract.needs_of``: ``"exact"`` unless it says
    otherwise; the optimizer state refused the ones that cannot run here, e.g. stage 0 only, before), or with a
    ``quantized`` codec (``zero_quantized_gradients``) the quantized one."""
    declared = needs_of(optimizer).gradient_exchange
    if quantized is None:
        return EXCHANGES[declared](optimizer, flats, reducer, group_of_flat)
    if declared != "exact":
        raise NotImplementedError(
            f"zero_optimization.zero_quantized_gradients with optimizer {type(optimizer).__name__}: the optimizer "
            "compresses the gradient exchange itself after its warm-up; use one of the two"
        )
    return QuantizedExchange(optimizer, flats, reducer, group_of_flat, quantized)
