"""Getting state out of an engine and back in, beside the loop: whole weights (``consolidated_state_dict``,
``save_16bit_model`` and the names Accelerate and HF call), and the sharded training checkpoint
(``save_checkpoint`` / ``load_checkpoint`` through the engine's checkpoint view). A base class of
:class:`~zeroshard.runtime.engine.ZeroshardEngine`."""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch

from .. import comm
from ..checkpoint.load import load as load_training_state
from ..checkpoint.save import save as save_training_state
from ..checkpoint.view import TrainingState
from ..log import log_rank0
from ..moe import expert_names
from ..tensor_parallel import layer_specs_from, splits_at
from ..zero import consolidated_state_dict


class CheckpointAndExport:
    """Whole weights and training checkpoints of an engine (see the module)."""

    def module_state_dict(
        self, destination=None, prefix: str = "", keep_vars: bool = False, exclude_frozen_parameters: bool = False
    ) -> dict:
        """The module's own ``state_dict`` (under stage 3 what this rank holds of it: gather with
        ``consolidated_state_dict`` for whole weights), without frozen parameters if asked, as DeepSpeed's."""
        state = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            for name, param in self.module.named_parameters():
                if not param.requires_grad:
                    state.pop(prefix + name, None)
        return state

    def consolidated_state_dict(self, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The module's full state dict on CPU in the compute dtype. Under stage 3 it is gathered one flat
        group at a time, so no rank ever holds more than one gathered unit besides the result; under tensor
        parallelism each split parameter's pieces are joined. Every rank must call it; with ``rank0_only`` the
        others get ``{}``."""
        self.stack.refuse_if_offloaded("consolidated_state_dict", weights_only=True)
        return consolidated_state_dict(
            self.module,
            self.stack.all_flat_groups,
            rank0_only=rank0_only,
            split_groups=self.mesh.pieces,
            splits=self.tensor_splits,
            expert_names=expert_names(self.module, self.mesh.expert.size),
        )

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """DeepSpeed's name for ``stage3_gather_16bit_weights_on_model_save``."""
        return self.settings.zero_optimization.gather_16bit_weights_on_model_save

    def _consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict:
        """DeepSpeed's name for the full state dict when weights are split (stage 3 or tensor parallelism), which
        Accelerate saves through: on rank 0, ``{}`` elsewhere (every rank must call it)."""
        if self.zero_optimization_stage() != 3 and self.autotp_size() == 1:
            raise ValueError(
                "_consolidated_16bit_state_dict applies when weights are split (ZeRO stage 3 or "
                "tensor_parallel.autotp_size > 1); use engine.module.state_dict()"
            )
        return self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict:
        """The full compute-dtype state dict on rank 0 (``{}`` elsewhere), gathered unit by unit; the name
        Accelerate and HF call (every rank must call it)."""
        state = self.consolidated_state_dict(rank0_only=True)
        if exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        return state

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
        """Write the full compute-dtype weights from rank 0 (every rank must call it). Under stage 3 this needs
        ``stage3_gather_16bit_weights_on_model_save``; returns whether a file was written."""
        if self.zero_optimization_stage() == 3 and not self.zero_gather_16bit_weights_on_model_save():
            log_rank0(
                "save_16bit_model: not saved, because zero_optimization.stage3_gather_16bit_weights_on_model_save "
                "is false (set it to true to gather the sharded weights)"
            )
            return False
        state = self.consolidated_state_dict(rank0_only=True)
        if comm.get_rank() == 0:
            os.makedirs(save_dir, exist_ok=True)
            path = os.path.join(save_dir, save_filename)
            torch.save(state, path + ".tmp")
            os.replace(path + ".tmp", path)  # never leave a half-written file under the final name
        comm.barrier(self.mesh.world)
        return True

    def save_checkpoint(
        self,
        save_dir: str,
        tag: Optional[str] = None,
        client_state: Optional[dict] = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> str:
        """Save the full training state (every rank calls it); default tag ``global_step{N}``. ``client_state``
        may hold JSON values and tensors. See :mod:`zeroshard.checkpoint.save` for the format and guarantees.
        A tag the caller names replaces a checkpoint of that tag (as DeepSpeed does); a default step tag that this
        engine did not write (a checkpoint already in ``save_dir`` after a resume from an older step) is kept
        under another name instead."""
        if not isinstance(save_dir, (str, os.PathLike)) or not os.fspath(save_dir):
            raise ValueError(f"save_checkpoint(save_dir={save_dir!r}): name the directory to save into")
        save_dir = os.fspath(save_dir)
        step_tag = f"global_step{self.global_steps}"
        path = save_training_state(
            self._training_state(),
            save_dir,
            tag=tag,
            client_state=client_state,
            save_latest=save_latest,
            exclude_frozen_parameters=exclude_frozen_parameters,
            keep_replaced=tag is None and os.path.abspath(os.path.join(save_dir, step_tag)) not in self._saved_tags,
        )
        self._saved_tags.add(os.path.abspath(path))
        return path

    def load_checkpoint(
        self,
        load_dir: str,
        tag: Optional[str] = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
    ):
        """Load a checkpoint saved with any world size and stage; returns ``(load_path, client_state)``,
        or ``(None, None)`` with a warning when ``load_dir`` holds no checkpoint."""
        self.stack.refuse_if_offloaded("load_checkpoint")  # it would write into freed storages
        restored = load_training_state(
            self._training_state(),
            load_dir,
            tag=tag,
            load_module_strict=load_module_strict,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only,
            universal=self.settings.checkpoint.load_universal,
        )
        return restored.path, restored.client_state

    def _training_state(self) -> TrainingState:
        """The engine as a checkpoint sees it (``zeroshard.checkpoint.view``)."""
        sampler = getattr(self.training_dataloader, "sampler", None)
        resumable = hasattr(sampler, "load_state_dict") and hasattr(sampler, "consumed")  # zeroshard's own
        return TrainingState(
            module=self.module,
            mesh=self.mesh,
            config=self.settings,
            counters=self.counters,
            flat_groups=self.stack.flat_groups,
            frozen_groups=self.stack.frozen_groups,
            optimizer=self.stack if self.optimizer is not None else None,  # its per-flat-group state
            lr_scheduler=self.lr_scheduler,
            sampler=sampler if resumable else None,
            gradient_accumulation_steps=self.gradient_accumulation_steps(),
            fp16=self.fp16_enabled(),
            tensor_splits=self.tensor_splits,
            expert_names=expert_names(self.module, self.mesh.expert.size),
            splits_at=functools.partial(
                splits_at,
                self.module,
                layer_specs=layer_specs_from(self.settings.tensor_parallel),
                use_default_specs=self.settings.tensor_parallel.partition_config.use_default_specs,
            ),
        )
