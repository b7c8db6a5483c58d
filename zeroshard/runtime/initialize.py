"""``zeroshard.initialize``: DeepSpeed's entry point, so existing scripts port by changing the import."""

from __future__ import annotations

import argparse
import warnings
from typing import Any, Callable, Optional, Union

import torch
from torch.utils.data import DataLoader, Dataset

from .. import comm
from ..accelerator import get_accelerator
from ..config import AutoContext, model_hidden_size, parse_config, resolve_config
from ..inference.weights import open_source
from ..offload import OffloadPlan
from ..optim import build_optimizer, build_schedule, check_client_optimizer
from ..precision import LossScaler, PrecisionPolicy
from ..zero import ZeroOptimizer
from ..zero.init import Materializer, has_meta_parameters, pending_seed, release_pending
from ..zero.sharded_param import adopt
from ..zero.stage3 import Stage3Runtime, build_units, plan_units
from .engine import ZeroshardEngine
from .log import log_rank0
from .sampler import ResumableDistributedSampler

OptimizerArg = Union[torch.optim.Optimizer, Callable[..., torch.optim.Optimizer], None]


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--deepspeed/--zeroshard`` and ``--deepspeed_config/--zeroshard_config`` to a parser."""
    group = parser.add_argument_group("zeroshard", "zeroshard / DeepSpeed configuration")
    group.add_argument(
        "--deepspeed",
        "--zeroshard",
        dest="deepspeed",
        action="store_true",
        default=False,
        help="enable zeroshard (accepted for DeepSpeed compatibility)",
    )
    group.add_argument(
        "--deepspeed_config",
        "--zeroshard_config",
        dest="deepspeed_config",
        default=None,
        type=str,
        help="path to the DeepSpeed-format JSON config",
    )
    return parser


def _config_source(args: Any, config: Any):
    from_args = None
    if args is not None:
        from_args = getattr(args, "zeroshard_config", None) or getattr(args, "deepspeed_config", None)
    if config is not None and from_args is not None:
        raise ValueError(
            f"a config was passed both as config= and as args.deepspeed_config ({from_args!r}); pass only one"
        )
    source = config if config is not None else from_args
    if source is None:
        raise ValueError("no config: pass config= (a dict or JSON path) or args.deepspeed_config")
    return source


def _param_groups(module: torch.nn.Module, model_parameters: Any) -> list[dict]:
    if model_parameters is None:
        return [{"params": list(module.parameters())}]
    items = list(model_parameters)
    if items and isinstance(items[0], dict):
        return [{**g, "params": list(g["params"])} for g in items]
    return [{"params": items}]


def _adopt_client_optimizer(client: torch.optim.Optimizer):
    """Point the client's own parameter groups at the master shards, so a scheduler bound to it keeps working."""

    def make(master_groups: list[dict]) -> torch.optim.Optimizer:
        for target, group in zip(client.param_groups, master_groups):
            target["params"] = group["params"]
        client.state.clear()
        return client

    return make


def _move_module(module: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """``module.to(device, dtype)`` that leaves meta (zero.Init) parameters for the materializer."""
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            if not tensor.is_meta:
                tensor.data = tensor.data.to(device=device, dtype=dtype if tensor.is_floating_point() else None)


def _broadcast_module(module: torch.nn.Module, group: comm.Group) -> None:
    """Start every rank from rank 0's weights, as DDP and DeepSpeed do."""
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            if tensor.is_meta:
                continue  # built under zero.Init: materialized identically on every rank from one seed
            comm.broadcast(tensor.data, src=group.ranks[0], group=group)


def _materializer(model: torch.nn.Module, pretrained: Any, world: comm.Group, device) -> Optional[Materializer]:
    """For a model built under zero.Init: what gives its parameters data, one flat group at a time (initial
    values from one seed shared by every rank, or ``pretrained`` weights, which must cover every parameter)."""
    if not has_meta_parameters(model):
        if pretrained is not None:
            raise ValueError(
                "pretrained= fills a model built under zeroshard.zero.Init; load a normally built model's weights "
                "(model.load_state_dict) before initialize"
            )
        return None
    seed = torch.tensor([pending_seed(model) or 0], dtype=torch.int64)
    comm.broadcast(seed, src=0, group=world)  # one seed for all ranks
    source = open_source(pretrained, model) if pretrained is not None else None
    materialize = Materializer(model, device, int(seed.item()), source)
    missing = materialize.missing() if source is not None else []
    if missing:
        raise ValueError(f"pretrained={pretrained!r} lacks {len(missing)} parameter(s) of the model: {missing[:8]}")
    return materialize


def _finish_materialization(model: torch.nn.Module, materialize: Materializer, device, dtype: torch.dtype) -> None:
    """Parameters outside the optimizer (frozen ones) are materialized whole; pretrained buffers are copied."""
    leftover = [p for p in model.parameters() if p.is_meta]
    materialize(leftover)
    for param in leftover:
        param.data = param.data.to(device=device, dtype=dtype)
    if materialize.source is not None:
        _load_buffers(model, materialize.source)
        materialize.source.close()


def _load_buffers(model: torch.nn.Module, source) -> None:
    """Buffers the pretrained weights carry (e.g. normalization statistics); zero.Init leaves buffers real."""
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name in source.names:
                buffer.copy_(source.read(name).to(buffer.dtype))


def _stage3_plan(model: torch.nn.Module, cfg, gather_unit_classes) -> tuple[list, frozenset]:
    """Gather units, and the parameters small enough to stay gathered (stage3_param_persistence_threshold)."""
    z = cfg.zero_optimization
    names = set(z.gather_unit_classes)
    for cls in gather_unit_classes or ():
        names.add(cls if isinstance(cls, str) else cls.__name__)
    plans = plan_units(model, frozenset(names), z.gather_unit_min_params)
    persistent = frozenset(p for p in model.parameters() if p.numel() < z.param_persistence_threshold)
    log_rank0(
        f"stage 3: {len(plans)} gather units ("
        + ", ".join(p.name or "<root>" for p in plans[:6])
        + (", ..." if len(plans) > 6 else "")
        + f"), {len(persistent)} persistent parameters"
    )
    return plans, persistent


def initialize(
    args: Any = None,
    model: Optional[torch.nn.Module] = None,
    optimizer: OptimizerArg = None,
    model_parameters: Any = None,
    training_data: Optional[Dataset] = None,
    lr_scheduler: Any = None,
    config: Any = None,
    dist_init_required: Optional[bool] = None,
    collate_fn: Optional[Callable] = None,
    config_params: Any = None,
    gather_unit_classes: Any = None,
    pretrained: Any = None,
):
    """Build an engine; returns ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    ``optimizer`` and ``lr_scheduler`` may be objects or callables (``params -> optimizer``,
    ``optimizer -> scheduler``); otherwise they are built from the config's blocks by name.
    ``gather_unit_classes`` (module classes or class names) adds to ``zero_optimization.gather_unit_classes``:
    under stage 3 each module of those classes is one gather unit.
    ``pretrained`` (a safetensors file, a Hugging Face checkpoint directory or a zeroshard checkpoint) fills a
    model built under ``zero.Init``: every rank reads the weights of one flat group at a time and keeps its
    shard, so no rank ever holds the whole model and nothing is broadcast.
    """
    if model is None:
        raise ValueError("initialize needs model=")
    if config is None:
        config = config_params
    source = _config_source(args, config)
    if not comm.is_initialized():
        if dist_init_required is False:
            raise ValueError("dist_init_required=False but torch.distributed is not initialized")
        comm.init_distributed()
    comm.destroy_at_exit()  # also when the caller (Lightning, accelerate, a user) created the process group
    parsed = parse_config(source)
    zero_cfg = parsed.zero_optimization

    grid = comm.build_rank_grid(zero_cfg.shard_group_size)
    dataloader_batch = training_data.batch_size if isinstance(training_data, DataLoader) else None
    resolution = resolve_config(
        parsed,
        AutoContext(
            world_size=grid.data_parallel_size,
            args=args,
            dataloader_batch_size=dataloader_batch,
            hidden_size=model_hidden_size(model),
        ),
    )
    cfg = resolution.config
    log_rank0(
        f"config resolved for {grid.data_parallel_size} rank(s), ZeRO stage {cfg.zero_optimization.stage}:\n"
        + resolution.report()
    )

    policy = PrecisionPolicy.from_config(cfg)
    accel = get_accelerator()
    if not accel.supports_dtype(policy.compute):
        raise ValueError(f"{policy.compute} is not supported on this {accel.name} device; disable bf16/fp16")
    device = accel.device(comm.backend.local_rank())
    offload = OffloadPlan.from_config(cfg.zero_optimization, cfg.aio, comm.get_rank(), accel.can_pin_memory)
    materialize = _materializer(model, pretrained, grid.world, device)
    _move_module(model, device, policy.compute)
    _broadcast_module(model, grid.world)

    zero = stage3 = None
    param_names = {p: name for name, p in model.named_parameters()}
    force_cpu_optimizer = offload.offloads_optimizer and cfg.zero_force_ds_cpu_optimizer
    if optimizer is not None or cfg.optimizer is not None:
        if isinstance(optimizer, torch.optim.Optimizer):
            if cfg.optimizer is not None:
                raise ValueError("both a client optimizer and an 'optimizer' config block were given; drop one")
            check_client_optimizer(
                optimizer, cfg.zero_optimization.stage, cfg.zero_allow_untested_optimizer, force_cpu_optimizer
            )
            groups = [dict(g) for g in optimizer.param_groups]
            make = _adopt_client_optimizer(optimizer)
        elif optimizer is not None:
            groups = _param_groups(model, model_parameters)

            def make(master_groups, factory=optimizer):
                built = factory(master_groups)
                check_client_optimizer(
                    built, cfg.zero_optimization.stage, cfg.zero_allow_untested_optimizer, force_cpu_optimizer
                )
                return built
        else:
            groups = _param_groups(model, model_parameters)

            def make(master_groups):
                return build_optimizer(
                    cfg.optimizer.type,
                    cfg.optimizer.params,
                    master_groups,
                    zero_stage=cfg.zero_optimization.stage,
                    allow_untested=cfg.zero_allow_untested_optimizer,
                )

        unknown = [p for g in groups for p in g["params"] if p not in param_names]
        if unknown:
            raise ValueError(
                f"{len(unknown)} optimizer parameter(s) (first shape {tuple(unknown[0].shape)}) "
                "are not parameters of the model"
            )
        unit_plans, persistent = (
            _stage3_plan(model, cfg, gather_unit_classes) if cfg.zero_optimization.stage == 3 else ([], frozenset())
        )
        zero = ZeroOptimizer(
            groups,
            param_names,
            make,
            stage=cfg.zero_optimization.stage,
            grid=grid,
            policy=policy,
            loss_scaler=LossScaler.from_config(cfg.fp16),
            bucket_size=cfg.zero_optimization.reduce_bucket_size,
            overlap_comm=cfg.zero_optimization.overlap_comm,
            gradient_clipping=cfg.gradient_clipping,
            ignore_unused_parameters=cfg.zero_optimization.ignore_unused_parameters,
            gradient_predivide_factor=cfg.gradient_predivide_factor,
            max_consecutive_skipped_steps=cfg.max_consecutive_skipped_steps,
            device=device,
            units=[plan.params for plan in unit_plans],
            persistent=persistent,
            materialize=materialize,
            offload=offload,
        )
        if unit_plans:
            root_unit, units = build_units(unit_plans, zero.flat_groups)
            z = cfg.zero_optimization
            stage3 = Stage3Runtime(
                model,
                root_unit,
                units,
                z.prefetch_bucket_size,
                z.max_live_parameters,
                fetch_ahead=offload.param_buffer_count - 1 if offload.param_device == "nvme" else 0,
            )
            zero.on_flat_group_complete = stage3.on_flat_group_complete

    if materialize is not None:
        _finish_materialization(model, materialize, device, policy.compute)
    release_pending(model.parameters())  # also those a gather materialized before initialize (HF's loading)
    if stage3 is not None:  # every stage-3 parameter answers DeepSpeed's ds_* attributes, resident and frozen too
        for param in model.parameters():
            adopt(param)

    scheduler = None
    if lr_scheduler is not None:
        if cfg.scheduler is not None:
            warnings.warn(
                "both lr_scheduler= and a 'scheduler' config block were given; using lr_scheduler=", stacklevel=2
            )
        scheduler = lr_scheduler if hasattr(lr_scheduler, "step") else lr_scheduler(zero.optimizer)
    elif cfg.scheduler is not None and zero is not None:
        scheduler = build_schedule(cfg.scheduler.type, cfg.scheduler.params, zero.optimizer)

    dataloader = None
    if training_data is not None:
        if isinstance(training_data, DataLoader):
            dataloader = training_data
        else:
            sampler = ResumableDistributedSampler(
                training_data, num_replicas=grid.data_parallel_size, rank=grid.world.rank, shuffle=True
            )
            dataloader = DataLoader(
                training_data,
                batch_size=resolution.batch.micro_batch_size,
                sampler=sampler,
                collate_fn=collate_fn,
                drop_last=cfg.dataloader_drop_last,
            )

    engine = ZeroshardEngine(model, zero, scheduler, resolution, grid, policy, device, dataloader, stage3)
    comm.LEDGER.reset()  # count training traffic, not the initial weight broadcast
    return engine, zero, dataloader, scheduler
