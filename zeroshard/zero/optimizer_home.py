"""Which home the optimizer state takes: the one ``offload_optimizer`` names (device, host or NVMe,
:mod:`.optimizer_state` and :mod:`.offloaded_state`), the flat groups ``offload_optimizer.ratio`` keeps on the compute
device, and whether the offloaded step runs during backward (``super_offload``, :mod:`.speculation`)."""

from __future__ import annotations

from typing import Callable, Mapping, Optional

import torch

from .. import comm
from ..accelerator import get_accelerator
from ..offload import OffloadPlan, choose_kept
from ..optim.contract import needs_of
from .flat_group import FlatGroup
from .offloaded_state import HostState, NvmeState
from .optimizer_state import DeviceState, MakeOptimizer, OptimizerState
from .speculation import Speculation, SpeculationPolicy


def build_optimizer_state(
    flats: list[FlatGroup],
    *,
    group_of_flat: list[int],
    param_groups: list[dict],
    make_optimizer: MakeOptimizer,
    master_dtype: torch.dtype,
    offload: OffloadPlan,
    synchronize: Callable[[], None],
    pieces: Optional[Mapping[str, comm.Group]] = None,
) -> OptimizerState:
    """The optimizer state in the home ``offload_optimizer`` names (``pieces``: the group along each split axis,
    over which optimizers that read whole parameters complete them)."""
    args = (flats, group_of_flat, param_groups, make_optimizer)
    if offload.optimizer_device in ("nvme", "cpu"):
        kept = kept_on_device([flat.layout.shard_numel for flat in flats], offload)
    if offload.optimizer_device == "nvme":
        state = NvmeState(
            *args, master_dtype=master_dtype, offload=offload, synchronize=synchronize, pieces=pieces, kept=kept
        )
    elif offload.optimizer_device == "cpu":
        state = HostState(
            *args,
            master_dtype=master_dtype,
            sub_group_size=offload.sub_group_size,
            pin_memory=offload.pin_memory,
            pieces=pieces,
            kept=kept,
        )
    else:
        return DeviceState(*args, master_dtype=master_dtype, pieces=pieces)
    _enable_speculation(state, offload)
    return state


def kept_on_device(numels: list[int], offload: OffloadPlan) -> frozenset[int]:
    """``offload_optimizer.ratio``: the flat groups (by their shard's ``numels``) kept on the compute device
    (:func:`~zeroshard.offload.choose_kept`); ``zeroshard estimate`` chooses through it too. ``"auto"``'s budget:
    ``keep_on_device_bytes``, else half the device's free memory now (the other half left to activations and
    gathered parameters)."""
    budget = offload.keep_on_device_bytes
    if budget is None and offload.ratio == "auto":
        budget = get_accelerator().available_memory() // 2
    return choose_kept(numels, offload.ratio, budget or 0)


def _enable_speculation(state: HostState, offload: OffloadPlan) -> None:
    """``offload_optimizer.super_offload``: the offloaded step during backward (:mod:`.speculation`). Possible for
    an elementwise optimizer exchanged exactly (its step is per sub-group, nothing in it a collective). By default on
    where it overlaps something: the disk's transfers (NVMe), or the CPU's step with an accelerator's backward
    (``cpu``; on a CPU-only machine the two would take turns on the same cores)."""
    if offload.speculate is False:
        return
    needs = needs_of(state.optimizer)
    if not (needs.elementwise and needs.gradient_exchange == "exact"):
        if offload.speculate:
            raise NotImplementedError(
                f"offload_optimizer.super_offload with {type(state.optimizer).__name__}: the step during backward "
                "needs an elementwise optimizer exchanged exactly (Adam, AdamW, Lion, SGD, Adagrad, ...); its "
                "step reads more than one sub-group or communicates. Set super_offload to false"
            )
        return
    if offload.speculate or offload.optimizer_device == "nvme" or state.can_step_behind:
        speculation = Speculation(comm.get_rank(), state.speculate, offload.speculation_cores, SpeculationPolicy())
        state.enable_speculation(speculation, offload.speculation_host_bytes)
