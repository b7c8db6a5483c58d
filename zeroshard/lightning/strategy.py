"""``ZeroshardStrategy``: Lightning's Trainer drives a zeroshard engine (ZeRO stages 0-3, offload) on GPUs and CPUs.

Lightning's own DeepSpeed strategy refuses CPUs and divides the loss by the accumulation twice; this one runs
anywhere zeroshard does, scales once, and stores Lightning's checkpoints as zeroshard's sharded, verified
checkpoint directories (one per ``ModelCheckpoint`` file name).
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Mapping, Optional, Union

import torch
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.types import LRSchedulerConfig

import zeroshard
from zeroshard import comm
from zeroshard.log import log_to_stdout
from zeroshard.zero import GatheredParameters, Init

from . import config as configs
from .precision import ZeroshardPrecision

CHECKPOINT_TAG = "checkpoint"  # the tag inside each Lightning checkpoint directory
_NOT_SAVED = ("state_dict", "optimizer_states")  # held by the engine's checkpoint itself


def join_process_group(strategy, backend: str, timeout: Optional[timedelta]) -> None:
    """Join through zeroshard (its exit handling applies) at the address and ranks Lightning's cluster
    environment chose; shared by the Trainer and Fabric strategies."""
    env = strategy.cluster_environment
    os.environ.update(
        {
            "MASTER_ADDR": env.main_address,
            "MASTER_PORT": str(env.main_port),
            "RANK": str(strategy.global_rank),
            "WORLD_SIZE": str(strategy.world_size),
            "LOCAL_RANK": str(strategy.local_rank),
        }
    )
    comm.init_distributed(backend, timeout=timeout or comm.DEFAULT_TIMEOUT)
    if not logging.root.handlers:
        # Lightning prints its own INFO lines when the application configured no logging (its logger gets a
        # stream handler then); zeroshard's lines under its strategies follow the same rule
        log_to_stdout()


class ZeroshardStrategy(DDPStrategy):
    """Train a ``LightningModule`` with a zeroshard engine.

    Either describe ZeRO with the arguments (``stage``, ``offload_optimizer``, ...; the names of DeepSpeed's
    Lightning strategy) or pass a full DeepSpeed-format ``config`` (dict or JSON path). The Trainer supplies
    ``accumulate_grad_batches``, ``gradient_clip_val`` and ``precision`` ("32-true", "16-mixed", "bf16-mixed").
    An ``optimizer`` block in the config replaces ``configure_optimizers`` (which may then return None).
    """

    strategy_name = "zeroshard"

    def __init__(
        self,
        stage: int = 2,
        offload_optimizer: bool = False,
        offload_parameters: bool = False,
        offload_optimizer_device: str = "cpu",
        offload_params_device: str = "cpu",
        nvme_path: str = "/local_nvme",
        pin_memory: bool = False,
        config: Union[None, str, os.PathLike, dict] = None,
        logging_batch_size_per_gpu: Union[str, int] = "auto",
        exclude_frozen_parameters: bool = False,
        accelerator=None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment=None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = comm.DEFAULT_TIMEOUT,
        **zero_kwargs: Any,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            precision_plugin=ZeroshardPrecision(),
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.config = configs.load_config(config) or configs.default_config(
            stage,
            offload_optimizer=offload_optimizer,
            offload_parameters=offload_parameters,
            offload_optimizer_device=offload_optimizer_device,
            offload_params_device=offload_params_device,
            nvme_path=nvme_path,
            pin_memory=pin_memory,
            **zero_kwargs,
        )
        self.logging_batch_size_per_gpu = logging_batch_size_per_gpu
        self.exclude_frozen_parameters = exclude_frozen_parameters
        self._engine: Optional[zeroshard.ZeroshardEngine] = None

    @property
    def precision_plugin(self) -> ZeroshardPrecision:
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin) -> None:
        """Lightning assigns a generic plugin when the strategy was given by name; keep its precision flag, but
        the engine does the work (no autocast, no GradScaler)."""
        if plugin is not None and not isinstance(plugin, ZeroshardPrecision):
            plugin = ZeroshardPrecision(getattr(plugin, "precision", "32-true"))
        self._precision_plugin = plugin

    # -- processes ----------------------------------------------------------------------------------------
    def setup_distributed(self) -> None:
        """Join the process group through zeroshard (Gloo on CPU, NCCL on GPU), so its exit handling applies."""
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        join_process_group(self, self._process_group_backend, self._timeout)

    @property
    def zero_stage_3(self) -> bool:
        return configs.zero_stage(self.config) == 3

    @property
    def handles_gradient_accumulation(self) -> bool:
        return True  # Lightning calls step every batch; the engine applies it at accumulation boundaries

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine reads its own checkpoint, so it must exist first

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # restored by the engine

    @property
    def engine(self) -> Optional[zeroshard.ZeroshardEngine]:
        return self._engine

    # -- building the engine --------------------------------------------------------------------------------
    def setup(self, trainer) -> None:
        self.accelerator.setup(trainer)
        # Trainer(precision=...) reaches a strategy instance only through the connector (Lightning keeps the
        # plugin the instance brought, ours, without telling it the flag)
        flag = getattr(trainer._accelerator_connector, "_precision_flag", None)
        if flag is not None:
            self.precision_plugin.precision = flag
        module = self.lightning_module
        if self._engine is None or self._engine.module is not module:
            self._engine = self._build_engine(trainer, fitting=trainer.state.fn == TrainerFn.FITTING)
        self.model = self._engine
        self.barrier()

    def setup_optimizers(self, trainer) -> None:
        """The engine builds the optimizer (from ``configure_optimizers`` or the config block) in ``setup``."""
        self.optimizers, self.lr_scheduler_configs = [], []

    def _build_engine(self, trainer, fitting: bool) -> zeroshard.ZeroshardEngine:
        module = self.lightning_module
        config = configs.complete_config(
            self.config,
            precision=self.precision_plugin.precision,
            accumulate_grad_batches=trainer.accumulate_grad_batches,
            gradient_clip_val=trainer.gradient_clip_val,
            gradient_clip_algorithm=str(trainer.gradient_clip_algorithm.value)
            if trainer.gradient_clip_algorithm
            else None,
            micro_batch_size=self._micro_batch_size(trainer),
        )
        optimizer, scheduler_config = None, None
        if not fitting:
            config.pop("optimizer", None)
            config.pop("scheduler", None)
        elif "optimizer" not in config:
            optimizers, schedulers = _init_optimizers_and_lr_schedulers(module)
            if len(optimizers) != 1 or len(schedulers) > 1:
                raise ValueError(
                    "zeroshard trains with one optimizer (and at most one LR scheduler); configure_optimizers returned "
                    f"{len(optimizers)} optimizer(s) and {len(schedulers)} scheduler(s)"
                )
            optimizer, scheduler_config = optimizers[0], (schedulers[0] if schedulers else None)
            if type(optimizer).__name__ == "_MockOptimizer":
                raise ValueError(
                    "configure_optimizers returned no optimizer and the config has no 'optimizer' block: give one"
                )
        engine, zero_optimizer, _, _ = zeroshard.initialize(
            model=module,
            model_parameters=[p for p in module.parameters() if p.requires_grad],
            optimizer=optimizer,
            config=config,
            dist_init_required=True,
        )
        if fitting:
            self.optimizers = [zero_optimizer]
            if engine.lr_scheduler is not None:  # from the config block: Lightning steps it, as it logs it
                scheduler_config = LRSchedulerConfig(engine.lr_scheduler, interval="step")
                engine.lr_scheduler = None
            self.lr_scheduler_configs = [scheduler_config] if scheduler_config is not None else []
        return engine

    def _micro_batch_size(self, trainer) -> Optional[int]:
        if self.logging_batch_size_per_gpu != "auto":
            return int(self.logging_batch_size_per_gpu)
        source = trainer.fit_loop._data_source
        if source.is_defined():
            loader = source.dataloader()
            sampler = getattr(loader, "batch_sampler", None)
            return getattr(sampler, "batch_size", None)
        return None

    def model_to_device(self) -> None:
        """``initialize`` places the model (a zero.Init model has nothing to move before that)."""

    @contextmanager
    def model_sharded_context(self):
        """Under stage 3, ``configure_model`` builds the model without ever holding all of it (``zero.Init``)."""
        with Init(config_dict_or_path=self.config) if self.zero_stage_3 else nullcontext():
            yield

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Not used: the engine's checkpoint holds the weights (gathering them here would cost a full copy)."""
        return {}

    def teardown(self) -> None:
        """Keep the engine (a later ``validate``/``test`` with the same module reuses it); release devices only.
        Moving the module to the CPU, as other strategies do, would touch stage-3 parameters without data."""
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    # -- checkpoints ------------------------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict, filepath, storage_options: Optional[Any] = None) -> None:
        """Every rank writes its shards into the directory ``filepath`` (e.g. ``epoch=0-step=8.ckpt/``); Lightning's
        own state (loops, callbacks, schedulers, hyperparameters) rides along as the checkpoint's client state."""
        if storage_options is not None:
            raise TypeError("ZeroshardStrategy.save_checkpoint does not take storage_options")
        filepath = self.broadcast(str(filepath))
        client = {k: v for k, v in checkpoint.items() if k not in _NOT_SAVED}
        self._engine.save_checkpoint(
            filepath, tag=CHECKPOINT_TAG, client_state=client, exclude_frozen_parameters=self.exclude_frozen_parameters
        )

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """A checkpoint directory saved by this strategy restores everything; a single file (e.g. from
        :func:`convert_zero_checkpoint_to_fp32_state_dict`) restores the weights (``load_model_state_dict``).
        ``weights_only=None`` (what ``Trainer.fit(ckpt_path=...)`` passes) is torch's default, ``True``, as in
        Lightning's own checkpoint IO: unpickling arbitrary objects runs code, so only an explicit ``False``
        (a file the caller trusts) allows it."""
        checkpoint_path = self.broadcast(str(checkpoint_path))
        if os.path.isfile(checkpoint_path):
            trusted = weights_only is False
            return torch.load(checkpoint_path, map_location="cpu", weights_only=not trusted)
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        _, client = self._engine.load_checkpoint(
            checkpoint_path,
            tag=None,
            load_optimizer_states=fitting,
            load_lr_scheduler_states=False,
            load_module_strict=self.lightning_module.strict_loading,
        )
        if client is None:
            raise FileNotFoundError(f"{checkpoint_path} holds no zeroshard checkpoint")
        return client

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Weights from a single-file checkpoint, written module by module inside a gather on rank 0 and kept on
        every rank; a checkpoint directory was already loaded by the engine."""
        if "state_dict" not in checkpoint:
            return
        state_dict, root = checkpoint["state_dict"], self.lightning_module
        names = {n for n, _ in root.named_parameters()}
        problems = [f"missing {sorted(names - set(state_dict))}"] if strict and names - set(state_dict) else []
        errors: list[str] = []
        for prefix, module in root.named_modules():
            with GatheredParameters(list(module.parameters(recurse=False)), modifier_rank=0):
                if self.global_rank == 0:
                    module._load_from_state_dict(state_dict, f"{prefix}." if prefix else "", {}, strict, [], [], errors)
        problems += self.broadcast(errors)  # shape errors are found on rank 0; every rank raises the same
        if problems:
            raise RuntimeError(f"loading the weights of {type(root).__name__} failed: {'; '.join(problems)}")

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """The engine restored the optimizer with the checkpoint directory."""

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        for name, description, kwargs in STRATEGIES:
            strategy_registry.register(name, cls, description=description, **kwargs)


STRATEGIES = [
    ("zeroshard", "zeroshard ZeRO (stage 2)", {}),
    ("zeroshard_stage_1", "zeroshard ZeRO stage 1", {"stage": 1}),
    ("zeroshard_stage_2", "zeroshard ZeRO stage 2", {"stage": 2}),
    (
        "zeroshard_stage_2_offload",
        "zeroshard ZeRO stage 2, optimizer on the CPU",
        {"stage": 2, "offload_optimizer": True},
    ),
    ("zeroshard_stage_3", "zeroshard ZeRO stage 3", {"stage": 3}),
    (
        "zeroshard_stage_3_offload",
        "zeroshard ZeRO stage 3, optimizer and parameters on the CPU",
        {"stage": 3, "offload_optimizer": True, "offload_parameters": True},
    ),
    (
        "zeroshard_stage_3_offload_nvme",
        "zeroshard ZeRO stage 3, optimizer and parameters on NVMe",
        {
            "stage": 3,
            "offload_optimizer": True,
            "offload_parameters": True,
            "offload_optimizer_device": "nvme",
            "offload_params_device": "nvme",
        },
    ),
]
