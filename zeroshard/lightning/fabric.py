"""``ZeroshardFabricStrategy``: Lightning Fabric drives a zeroshard engine, on GPUs and CPUs.

``fabric.setup(model, optimizer)`` returns the engine and its optimizer; ``fabric.backward(loss)`` and
``optimizer.step()`` go through the engine; ``fabric.save(path, state)`` writes a zeroshard checkpoint directory
with everything in ``state`` besides the module and optimizer as its client state, and ``fabric.load`` restores it.
Mixed precision comes from the config's ``fp16``/``bf16`` blocks (``Fabric(precision=...)`` stays "32-true": the
engine casts, not autocast)."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Optional, Union

import torch
from lightning.fabric.strategies import DDPStrategy
from torch.nn import Module
from torch.optim import Optimizer

import zeroshard
from zeroshard import comm
from zeroshard.zero import Init

from . import config as configs
from .strategy import CHECKPOINT_TAG, STRATEGIES, join_process_group


class ZeroshardFabricStrategy(DDPStrategy):
    def __init__(
        self,
        stage: int = 2,
        offload_optimizer: bool = False,
        offload_parameters: bool = False,
        config: Union[None, str, os.PathLike, dict] = None,
        accelerator=None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment=None,
        precision=None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = comm.DEFAULT_TIMEOUT,
        **zero_kwargs: Any,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.config = configs.load_config(config) or configs.default_config(
            stage, offload_optimizer=offload_optimizer, offload_parameters=offload_parameters, **zero_kwargs
        )
        self.config.setdefault("train_micro_batch_size_per_gpu", 1)
        self.config.setdefault("gradient_clipping", 0.0)  # Fabric clips only when asked; DeepSpeed's default is 1.0
        self._engine: Optional[zeroshard.ZeroshardEngine] = None

    def _setup_distributed(self) -> None:
        self._set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        join_process_group(self, self._process_group_backend, self._timeout)

    @property
    def zero_stage_3(self) -> bool:
        return configs.zero_stage(self.config) == 3

    @property
    def model(self) -> Optional[zeroshard.ZeroshardEngine]:
        """Fabric steps ``strategy.model`` (the engine) when it can: the engine applies the optimizer."""
        return self._engine

    def _check_precision(self) -> None:
        flag = getattr(self.precision, "precision", "32-true")
        if flag != "32-true":
            raise ValueError(
                f"Fabric(precision={flag!r}) with ZeroshardFabricStrategy: set the precision in the strategy's config "
                '({"bf16": {"enabled": true}} or {"fp16": {"enabled": true}}) and leave Fabric at "32-true"; the '
                "engine holds the parameters in that dtype and casts the inputs"
            )

    def setup_module_and_optimizers(self, module: Module, optimizers: list[Optimizer], scheduler=None):
        if len(optimizers) != 1:
            raise ValueError(f"zeroshard trains with one optimizer, got {len(optimizers)}")
        self._check_precision()
        self._engine, optimizer, _, scheduler = zeroshard.initialize(
            model=module,
            optimizer=optimizers[0],
            lr_scheduler=scheduler,
            config=self.config,
        )
        return self._engine, [optimizer], scheduler

    def setup_module(self, module: Module) -> zeroshard.ZeroshardEngine:
        self._check_precision()
        config = {k: v for k, v in self.config.items() if k not in ("optimizer", "scheduler")}
        self._engine, _, _, _ = zeroshard.initialize(model=module, config=config)
        return self._engine

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        raise NotImplementedError("set up the module and its optimizer together: fabric.setup(model, optimizer)")

    def module_sharded_context(self):
        return Init(enabled=self.zero_stage_3, config_dict_or_path=self.config)

    def module_init_context(self, empty_init: Optional[bool] = None):
        if self.zero_stage_3:
            return self.module_sharded_context()
        return super().module_init_context(empty_init=empty_init)

    def backward(self, tensor: torch.Tensor, module: Optional[Module], *args: Any, **kwargs: Any) -> None:
        self._engine.backward(tensor, *args, **kwargs)

    def optimizer_step(self, optimizer, **kwargs: Any) -> Any:
        return self._engine.step()

    def clip_gradients_norm(self, module, optimizer, max_norm, norm_type=2.0, error_if_nonfinite=True):
        raise NotImplementedError("set gradient_clipping in the strategy's config: the engine clips at the step")

    def _held_by_engine(self, value: Any) -> bool:
        """The module and optimizer: saved and restored by the engine's checkpoint itself."""
        return value is self._engine or value is self._engine.optimizer or isinstance(value, Module)

    def save_checkpoint(self, path, state: dict, storage_options=None, filter=None) -> None:
        if storage_options is not None or filter is not None:
            raise TypeError("ZeroshardFabricStrategy.save_checkpoint takes neither storage_options nor filter")
        path = self.broadcast(str(path))
        client = {
            k: (v.state_dict() if hasattr(v, "state_dict") else v)
            for k, v in state.items()
            if not self._held_by_engine(v)
        }
        self._engine.save_checkpoint(path, tag=CHECKPOINT_TAG, client_state=client)

    def load_checkpoint(self, path, state=None, strict: bool = True, weights_only=None) -> dict[str, Any]:
        """A checkpoint directory saved by ``fabric.save``. A single file is refused, never unpickled (whatever
        ``weights_only`` says): its weights are loaded into the model before ``fabric.setup``."""
        path = self.broadcast(str(path))
        if os.path.isfile(path):
            raise ValueError(
                f"{path} is a file; ZeroshardFabricStrategy loads the checkpoint directories fabric.save writes. Load "
                "a single file's weights into the model before fabric.setup (torch.load(..., weights_only=True))"
            )
        _, client = self._engine.load_checkpoint(path, load_module_strict=strict)
        if client is None:
            raise FileNotFoundError(f"{path} holds no zeroshard checkpoint")
        if not state:
            return client
        rest = dict(client)
        for key, target in state.items():
            if self._held_by_engine(target):
                continue
            if key not in rest:
                if strict:
                    raise KeyError(f"'{key}' is not in the checkpoint {path}")
                continue
            value = rest.pop(key)
            if hasattr(target, "load_state_dict"):
                target.load_state_dict(value)
            else:
                state[key] = value
        return rest

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        for name, description, kwargs in STRATEGIES:
            if name.endswith("nvme"):
                continue  # the Fabric strategy takes the device through its config
            strategy_registry.register(name, cls, description=description, **kwargs)
