"""What an optimizer needs from ZeRO to step a shard as one process steps the whole parameter, said once.

Under ZeRO an optimizer steps flat master shards: each holds a contiguous range of a flat group, pieces of many
parameters, and under tensor or expert parallelism those parameters are themselves pieces of the model's (a
*split axis*: ``tp`` or ``ep``). An elementwise update (Adam, SGD, Lion) is the same on a shard as on the whole
tensor. Others read more than their own elements, and each class declares what (:class:`Needs`, its
``zero_needs``; :func:`needs_of` answers for torch's classes too):

- ``parameter_norms``: each parameter's whole norms (Lamb's trust ratio);
- ``whole_matrices``: each parameter as the whole matrix the model defines (Muon's Newton-Schulz);
- ``gradient_exchange``: how the ranks' gradients reach it (``"exact"``: averaged by ZeRO; ``"momentum"``: 1-bit
  Adam's momentum averaged compressed by ZeRO; ``"optimizer_averaged"``: each rank's own gradients, the optimizer
  averaging compressed itself).

Every optimizer that needs more than its elements gets one :class:`ShardLayout`: where each parameter lies in its
shards, how to complete a partial norm (over the shard group, then the split axis), and how to make a matrix whole
(gather the shard, then join the pieces of the split axis). The ZeRO layer builds it (``zeroshard.zero``: the
communication is there, not here) and hands it over: at construction to an optimizer built by name, through
``zeroshard.optim.factory.bind_layout`` to one a client built. What no layout can give is refused by
:func:`refusal`, from the needs alone, never by class name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from ..comm import OneBitAllReduce

EXCHANGES = ("exact", "momentum", "optimizer_averaged")
AXIS_KEYS = {"tp": ("tensor", "tensor_parallel.autotp_size"), "ep": ("expert", "expert_parallel.autoep_size")}


@dataclass(frozen=True)
class Needs:
    """What an optimizer's update of one parameter reads beyond that parameter's own elements (see the module)."""

    parameter_norms: bool = False
    whole_matrices: bool = False
    gradient_exchange: str = "exact"

    def __post_init__(self):
        if self.gradient_exchange not in EXCHANGES:
            raise ValueError(f"unknown gradient_exchange {self.gradient_exchange!r}; expected one of {EXCHANGES}")

    @property
    def elementwise(self) -> bool:
        return not (self.parameter_norms or self.whole_matrices)

    @property
    def needs_layout(self) -> bool:
        """Whether the optimizer reads a :class:`ShardLayout` (its norms, its matrices or its compressed average)."""
        return not self.elementwise or self.gradient_exchange == "optimizer_averaged"


ELEMENTWISE = Needs()
_TORCH_MUON = getattr(torch.optim, "Muon", None)


def needs_of(optimizer: Union[torch.optim.Optimizer, type]) -> Needs:
    """The needs an optimizer (or its class) declares as ``zero_needs``; torch's Muon needs whole matrices; any
    other class is taken as elementwise (ZeRO refuses an unverified one unless ``zero_allow_untested_optimizer``)."""
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    declared = getattr(cls, "zero_needs", None)
    if isinstance(declared, Needs):
        return declared
    if _TORCH_MUON is not None and issubclass(cls, _TORCH_MUON):
        return Needs(whole_matrices=True)
    return ELEMENTWISE


@dataclass(frozen=True)
class MatrixPiece:
    """One matrix made whole for a shard that holds part of it: ``whole`` as the model defines it (on the compute
    device), and ``local(result)``, the part of a whole-shaped ``result`` that lies in the shard, flat, at
    ``[start, stop)`` of the shard."""

    whole: torch.Tensor
    start: int
    stop: int
    local: Callable[[torch.Tensor], torch.Tensor]


class ShardLayout:
    """Where the parameters lie in the master shards an optimizer steps, and the collectives that make their
    statistics whole. The ZeRO layer implements it (``zeroshard.zero.shard_layout``); one process has none."""

    # stage 0 with several ranks: the 1-bit all-reduce over them, for optimizers that average their own gradients
    # (0/1 Adam, 1-bit LAMB); it owns their compression errors
    compressed: Optional[OneBitAllReduce] = None

    @property
    def slot_count(self) -> int:
        """How many parameters every rank's shards hold pieces of, together (the width of :meth:`complete_norms`)."""
        raise NotImplementedError

    def segments(self, tensor: torch.Tensor) -> list[tuple[int, int, int]]:
        """The parameters in one master shard: ``(slot, start, numel)``, ``slot`` a column of
        :meth:`complete_norms`, ``[start, start + numel)`` the parameter's range in the shard."""
        raise NotImplementedError

    def complete_norms(self, partial: torch.Tensor) -> None:
        """Sums over this rank's pieces (``[rows, slot_count]``) made sums over each whole parameter, in place."""
        raise NotImplementedError

    def matrices(self, tensor: torch.Tensor, values: torch.Tensor) -> list[MatrixPiece]:
        """Each parameter with elements in master shard ``tensor``, with ``values`` (of the shard's shape: e.g. the
        update) made whole across the shard group and the split axis (a collective call on every rank)."""
        raise NotImplementedError


class LayoutAware:
    """A mixin for optimizers that read a :class:`ShardLayout`: ``layout=`` at construction, or bound once by the
    ZeRO layer when a client built the optimizer (``zeroshard.optim.factory.bind_layout``)."""

    layout: Optional[ShardLayout] = None

    def bind_layout(self, layout: Optional[ShardLayout]) -> None:
        if self.layout is not None and layout is not self.layout:
            raise ValueError(f"optimizer {type(self).__name__} already steps another ZeRO layout: build one per engine")
        self.layout = layout


def refusal(name: str, needs: Needs, *, partitioned: bool, axes: dict[str, int], whole_shards: bool) -> Optional[str]:
    """Why optimizer ``name`` cannot step exactly here, or None: ``partitioned`` whether ZeRO shards the optimizer
    state (stages 1-3), ``axes`` the split axes of this run (axis -> size, above 1), ``whole_shards`` whether each
    flat group's shard is stepped in one piece (not cut into sub-groups, nor swapped through NVMe)."""
    if needs.gradient_exchange == "optimizer_averaged" and partitioned:
        return (
            f"optimizer {name} runs with zero_optimization.stage 0 only (it averages whole tensors itself, so every "
            "rank must hold them); use stage 0, or OneBitAdam, which runs with ZeRO stages 0-3"
        )
    if not needs.elementwise and not whole_shards:
        return (
            f"optimizer {name} reads each parameter's whole norms or matrix, gathered from each flat group's shards, "
            "so the optimizer state must be in host memory (device 'cpu', not 'nvme') with each flat group's shard "
            "in one sub-group (zero_optimization.sub_group_size at least reduce_bucket_size / ranks; its default 1e9 "
            "is); or use Adam/AdamW, Adagrad, Lion or SGD"
        )
    if needs.gradient_exchange != "exact" and "ep" in axes:
        what, key = AXIS_KEYS["ep"]
        return (
            f"optimizer {name} with {what} parallelism ({key} {axes['ep']}): its 1-bit exchange averages over every "
            "data-parallel rank, while expert gradients sum over the ranks holding the same experts; use AdamW "
            f"(or another exact optimizer), or train without {what} parallelism"
        )
    if needs.gradient_exchange == "optimizer_averaged" and axes:
        axis = next(iter(axes))
        what, key = AXIS_KEYS[axis]
        return (
            f"optimizer {name} with {what} parallelism ({key} {axes[axis]}): it averages whole tensors itself, "
            "1-bit compressed, with one scale per parameter; each rank holds pieces, so the compression (and 1-bit "
            f"LAMB's trust ratios) would differ from an unsplit run. Use OneBitAdam or AdamW, or train without {what} "
            "parallelism"
        )
    return None


__all__ = [
    "ELEMENTWISE",
    "LayoutAware",
    "MatrixPiece",
    "Needs",
    "ShardLayout",
    "needs_of",
    "refusal",
]
