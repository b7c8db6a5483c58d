"""What a checkpoint saves and restores, as an interface: the engine hands :func:`zeroshard.checkpoint.save.save`
and ``load`` a :class:`TrainingState` instead of itself, so checkpointing depends on these names only."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

import torch

from ..comm import Mesh
from ..partition import TensorSplit
from ..precision import LossScaler


class ShardedOptimizer(Protocol):
    """The optimizer side of a checkpoint (``zeroshard.zero.ZeroStack`` provides it): per flat group, this
    rank's master shard and elementwise optimizer state as tensors, the non-elementwise state as scalars."""

    loss_scaler: LossScaler
    master_dtype: torch.dtype
    state_device: torch.device  # where a flat group's loaded state is assembled

    @property
    def param_groups(self) -> list[dict]: ...

    @property
    def kind(self) -> str: ...  # the update rule ("AdamW", "Adam", the optimizer's class): saved, checked at load

    def flat_state_keys(self, index: int) -> list[str]: ...

    def flat_scalars(self, index: int) -> dict: ...

    def flat_param_group(self, index: int) -> int: ...

    def read_flat(self, index: int) -> dict[str, torch.Tensor]: ...

    def read_frozen(self, index: int) -> torch.Tensor: ...

    def write_flat(self, index: int, tensors: dict[str, torch.Tensor], scalars: dict) -> None: ...

    def publish(self) -> None: ...

    def compression_state(self) -> dict[str, torch.Tensor]: ...

    def load_compression_state(self, tensors: dict[str, torch.Tensor]) -> bool: ...


@dataclass
class TrainingCounters:
    """The engine's progress: optimizer steps (applied or skipped), samples, skipped steps, micro-batches."""

    global_steps: int = 0
    global_samples: int = 0
    skipped_steps: int = 0
    micro_steps: int = 0


@dataclass(frozen=True)
class PipelinePlacement:
    """Which parameters of a pipeline's model a stage holds, by the names DeepSpeed's ``PipelineModule`` gives them
    (layer ``i``'s under ``"i."``, a tied module under ``"tied_modules.<key>."``), so one checkpoint holds every
    stage's parameters under names that do not depend on the partition. A tied module's copies are equal: the
    first stage holding it saves it, the others (``mirrored_keys``) read it back from there."""

    stages: int  # the pipeline's ranks (each writes its stage's entries)
    parts: tuple[int, ...]  # stage s holds layers parts[s] .. parts[s + 1] - 1
    stage: int
    tied_keys: frozenset  # the tied modules this stage holds
    mirrored_keys: frozenset  # those of them an earlier stage saves
    # (layer index, tie key or "") of each layer DeepSpeed writes a layer file for (PipelineModule.layer_state_files)
    layer_files: tuple = ()
    # the model's stages (parts' indices) this rank runs: its own (empty), or DualPipeV's two
    chunks: tuple = ()

    def _layer_or_tie(self, name: str) -> tuple[Optional[int], Optional[str]]:
        head, _, rest = name.removeprefix("module.").partition(".")
        if head.isdigit():
            return int(head), None
        return None, rest.partition(".")[0] if head == "tied_modules" else None

    def holds(self, name: str) -> bool:
        """Whether this stage holds the tensor ``name`` (names outside layers and ties: every stage's)."""
        layer, tie = self._layer_or_tie(name)
        if layer is not None:
            return any(self.parts[c] <= layer < self.parts[c + 1] for c in self.chunks or (self.stage,))
        return tie is None or tie in self.tied_keys

    def mirrors(self, name: str) -> bool:
        """Whether ``name`` is this stage's copy of a tensor an earlier stage saves."""
        return self._layer_or_tie(name)[1] in self.mirrored_keys

    def record(self) -> dict:
        # the model's stages, as ``parts`` cuts it (DualPipeV's are twice its ranks)
        stages = len(self.parts) - 1
        return {"stages": stages, "parts": list(self.parts), "layer_files": [list(f) for f in self.layer_files]}


@dataclass(frozen=True)
class TrainingState:
    """The engine as a checkpoint sees it. ``counters`` is the engine's own object: a load restores it in place."""

    module: torch.nn.Module
    mesh: Mesh
    config: Any  # zeroshard.config.ZeroshardConfig (saved in the manifest; its checkpoint block decides tags)
    counters: TrainingCounters
    flat_groups: list  # zeroshard.zero.FlatGroup: the trainable ones, stepped by ``optimizer`` ([] without one)
    frozen_groups: list  # stage 3: flat groups of parameters without gradients (saved from their shards)
    optimizer: Optional[ShardedOptimizer]  # None: an engine built without one (no flat groups)
    lr_scheduler: Any  # state_dict / load_state_dict, or None
    sampler: Any  # zeroshard's resumable sampler (state_dict / load_state_dict), or None
    gradient_accumulation_steps: int
    fp16: bool
    # tensor parallelism: how each split parameter is cut over ``mesh.tensor`` (by name; the others are replicated)
    tensor_splits: dict[str, TensorSplit] = field(default_factory=dict)
    # how the model's parameters are cut over N tensor-parallel ranks (its own placement at that degree): a
    # checkpoint's split records must agree; None where the engine cannot say
    splits_at: Optional[Callable[[int], dict[str, TensorSplit]]] = None
    # one tensor per expert (DeepSpeed's MoE layer) split over ``mesh.expert``: local name -> its name under the global
    # expert index on each expert rank (rank r's copy i is expert r * L + i); checkpoints hold every expert by it
    expert_names: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # a pipeline stage: which of the whole model's parameters it holds (None: every one)
    pipeline: Optional[PipelinePlacement] = None

    def holds(self, name: str) -> bool:
        return self.pipeline is None or self.pipeline.holds(name)

    def mirrors(self, name: str) -> bool:
        return self.pipeline is not None and self.pipeline.mirrors(name)
