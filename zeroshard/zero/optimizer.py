"""The ZeRO optimizer as clients see it: a ``torch.optim.Optimizer`` view of the stack.

Lightning, Accelerate, the HF Trainer and LR schedulers hold ``engine.optimizer`` and expect a torch optimizer:
``param_groups``, ``state``, ``defaults``, ``step``, ``zero_grad``, ``state_dict`` / ``load_state_dict``, and
DeepSpeed's ``loss_scale`` / ``cur_scale`` / ``overflow``. They are this view's; everything it reads or changes
belongs to the :class:`~zeroshard.zero.stack.ZeroStack` (its flat groups, optimizer state, reducer, loss scaler and
exchange). The base class's constructor is not run: the groups are the wrapped optimizer's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

from .. import comm
from ..optim import update_rule

if TYPE_CHECKING:
    from .stack import ZeroStack


class ZeroOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` over the stack's master shards (see the module docstring)."""

    def __init__(self, stack: "ZeroStack"):
        self.stack = stack
        self.optimizer = stack.optimizer_state.optimizer  # the torch optimizer over the master shards
        self.defaults = self.optimizer.defaults

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self):
        self.stack.settle()  # a step running behind the forward writes it
        return self.optimizer.state

    def step(self, closure=None) -> bool:
        """The stack's step; returns False when an fp16 overflow skipped it. A ``closure`` (torch's convention) is
        evaluated first."""
        if closure is not None:
            with torch.enable_grad():
                closure()
        return self.stack.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.stack.zero_grad()

    def add_param_group(self, param_group: dict) -> None:
        raise NotImplementedError(
            "parameters cannot join a ZeRO optimizer after initialize (they would not be sharded or reduced); "
            "pass every parameter group to initialize"
        )

    @property
    def loss_scale(self) -> float:
        return self.stack.loss_scaler.scale

    cur_scale = loss_scale  # DeepSpeed's fp16 optimizers use both names

    @property
    def overflow(self) -> bool:
        """DeepSpeed's name: whether the last step was skipped for non-finite gradients."""
        return self.stack.overflow

    @property
    def global_grad_norm(self) -> Optional[float]:
        return self.stack.global_grad_norm

    @property
    def compressed_from(self) -> Optional[int]:
        """The first global step of a 1-bit optimizer's compressed phase (None: not reached, or exact)."""
        return self.stack.exchange.compressed_from

    @property
    def kind(self) -> str:
        """The update rule, as a checkpoint records it (``optim.update_rule``)."""
        return update_rule(self.optimizer)

    def offload_states(
        self, include=None, device: Any = "cpu", pin_memory: bool = True, non_blocking: bool = False
    ) -> None:
        """DeepSpeed's ``optimizer.offload_states`` (see ``ZeroStack.offload_states``)."""
        self.stack.offload_states(include, device, pin_memory, non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        self.stack.reload_states(non_blocking)

    def state_dict(self) -> dict:
        """This rank's shard of the optimizer state (master weights, elementwise state and step counters per flat
        group) and the loss scaler: what a ZeRO optimizer's ``state_dict`` holds in DeepSpeed too. It loads back
        into the same world size and stage only; resharding goes through ``engine.save_checkpoint``."""
        stack = self.stack
        return {
            "zeroshard_shard": {
                "shard_rank": [flat.shard_rank for flat in stack.flat_groups],
                "shard_numel": [flat.layout.shard_numel for flat in stack.flat_groups],
                "flat_groups": [
                    {"tensors": {k: v.clone() for k, v in stack.read_flat(i).items()}, "scalars": stack.flat_scalars(i)}
                    for i in range(len(stack.flat_groups))
                ],
            },
            "loss_scaler": stack.loss_scaler.state_dict(),
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
        }

    def load_state_dict(self, state_dict: dict) -> None:
        stack = self.stack
        shard = state_dict.get("zeroshard_shard")
        if shard is None:
            raise ValueError("ZeroOptimizer.load_state_dict: not a zeroshard optimizer state (no 'zeroshard_shard')")
        mine = [flat.layout.shard_numel for flat in stack.flat_groups]
        ranks = [flat.shard_rank for flat in stack.flat_groups]
        if shard["shard_numel"] != mine or shard["shard_rank"] != ranks:
            raise ValueError(
                f"rank {comm.get_rank()}: optimizer state of shards {shard['shard_numel']} (shard ranks "
                f"{shard['shard_rank']}) does not fit this optimizer's {mine} ({ranks}): it was saved with another "
                "world size, stage or model; use engine.save_checkpoint/load_checkpoint to change those"
            )
        for index, group in enumerate(shard["flat_groups"]):
            stack.write_flat(index, group["tensors"], group["scalars"])
        for target, saved in zip(self.param_groups, state_dict.get("param_groups", [])):
            target.update(saved)
        stack.loss_scaler.load_state_dict(state_dict["loss_scaler"])
        stack.publish()
