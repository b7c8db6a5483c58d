"""``zeroshard.initialize``: DeepSpeed's entry point, so existing scripts port by changing the import."""

from __future__ import annotations

import argparse
import functools
import warnings
from typing import Any, Callable, Optional

import torch
from torch.utils.data import DataLoader, Dataset

from .. import comm
from ..accelerator import bound_host_heap, get_accelerator
from ..checkpoint.resume import agree_on_resume_point
from ..checkpoint.weights import open_source
from ..config import AutoContext, Resolution, model_hidden_size, parse_config, resolve_config
from ..log import log_as_launched, log_rank0, logger
from ..offload import OffloadPlan
from ..optim import build_schedule
from ..precision import PrecisionPolicy, fp32_buffer_rules, fp32_buffers
from ..zero import Placement, ZeroOptimizer, ZeroStack, build_zero_stack
from ..zero.materialize import Materializer, has_meta_parameters, pending_seed, release_pending
from ..zero.planning import is_packed
from . import activation_checkpointing
from .batch_check import check_same_batch_settings
from .engine import ZeroshardEngine
from .optimizer_recipe import OptimizerArg, optimizer_recipe
from .parallelize import (
    ParallelPlan,
    expert_parallel_size,
    parallelize,
    pipeline_stages,
    refuse_experts_split_by_transformers,
    tensor_parallel_size,
)
from .pipeline_engine import PipelineEngine
from .sampler import distributed_loader


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


def _move_module(module: torch.nn.Module, device: torch.device, policy: PrecisionPolicy) -> None:
    """Parameters to the device in the compute dtype, leaving meta (zero.Init) ones for the materializer and packed
    quantized ones in their storage dtype; buffers to the device in ``data_types.buffer_dtype`` when set, else in
    the dtype they have (as DeepSpeed 0.19), and those the model names for fp32 in fp32 (``keep_in_fp32_modules``;
    an upcast when they arrive in a lower precision, as DeepSpeed's)."""
    kept = {id(b) for _, b in fp32_buffers(module, fp32_buffer_rules(module, policy.fp32_buffers, policy.compute))}
    with torch.no_grad():
        for param in module.parameters():
            if not param.is_meta:
                cast = param.is_floating_point() and not is_packed(param)
                param.data = param.data.to(device=device, dtype=policy.compute if cast else None)
        for buffer in (b for b in module.buffers() if not b.is_meta):
            dtype = torch.float32 if id(buffer) in kept else policy.buffer if buffer.is_floating_point() else None
            buffer.data = buffer.data.to(device=device, dtype=dtype)


def _sequence_parallel(mpu: Any, parsed) -> tuple[int, Optional[comm.Mesh], Optional[tuple[int, ...]]]:
    """The sequence-parallel degree and what ``mpu`` brings: ``register_with_transformers``'s mesh (the engine's
    mesh refines it), or the ranks of the sequence group of another object with DeepSpeed's sequence-parallel getters
    (the engine builds a group of the same ranks). Other mpu shapes (Megatron's model parallelism) are refused by
    name; ``sequence_parallel_size`` in the config must agree with the mpu when both are given."""
    configured = parsed.sequence_parallel_size
    if mpu is None:
        return configured, None, None
    if not hasattr(mpu, "get_sequence_parallel_world_size"):
        raise NotImplementedError(
            f"initialize(mpu=...): an mpu of type {type(mpu).__name__} without get_sequence_parallel_world_size(); "
            "zeroshard takes an mpu for Ulysses sequence parallelism only (register_with_transformers returns one). "
            "For tensor parallelism set tensor_parallel.autotp_size in the config"
        )
    size = int(mpu.get_sequence_parallel_world_size())
    if "sequence_parallel_size" in parsed.model_fields_set and configured != size:
        raise ValueError(
            f"sequence_parallel_size {configured} in the config but the mpu's sequence-parallel group has {size} "
            "ranks; make them agree (or drop the key: the mpu sets it)"
        )
    registered = getattr(mpu, "mesh", None)
    if isinstance(registered, comm.Mesh):
        return size, registered, None
    return size, None, comm.group_of(mpu.get_sequence_parallel_group(), "sequence").ranks


def _engine_mesh(dims: comm.ParallelDims, registered: Optional[comm.Mesh], sequence: Optional[tuple]) -> comm.Mesh:
    """The registered mesh when the config adds nothing to it, else a mesh of ``dims`` refining it; an mpu's
    sequence group must be one of the mesh's."""
    if sequence is not None and list(sequence) not in dims.derived("sequence"):
        raise ValueError(
            f"the mpu's sequence-parallel group {list(sequence)} is not one of {dims.derived('sequence')}: "
            f"sequence_parallel_size {dims.sp} with tensor_parallel.autotp_size {dims.tp} groups ranks tp apart "
            "(pass tensor_parallel_size= to register_with_transformers)"
        )
    if registered is not None and registered.dims == dims:  # the mesh built once, at registration
        return registered
    return comm.build_mesh(dims, base=registered)


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
    materialize = Materializer(model, device, int(seed.item()), world=world, source=source)
    if source is not None:
        missing = materialize.missing()
        if missing:
            source.close()
            raise ValueError(f"pretrained={pretrained!r} lacks {len(missing)} parameter(s) of the model: {missing[:8]}")
        _check_buffers(model, source, pretrained)
    return materialize


def _check_buffers(model: torch.nn.Module, source, pretrained: Any) -> None:
    """Buffers are weights too (normalization statistics, codebooks): a persistent one (in ``state_dict``) must be
    in ``pretrained`` as parameters must, and every one found there must have the model's shape; checked before
    anything is sharded."""
    persistent = set(model.state_dict(keep_vars=True))
    buffers = dict(model.named_buffers())
    missing = sorted(name for name in buffers if name in persistent and name not in source.names)
    wrong = [
        f"'{name}': pretrained {tuple(source.shape(name))}, the model {tuple(buffer.shape)}"
        for name, buffer in buffers.items()
        if name in source.names and tuple(source.shape(name)) != tuple(buffer.shape)
    ]
    if missing or wrong:
        source.close()
        problems = [f"lacks {len(missing)} buffer(s) of the model: {missing[:8]}"] if missing else []
        problems += [f"has buffers of the wrong shape: {'; '.join(wrong[:8])}"] if wrong else []
        raise ValueError(f"pretrained={pretrained!r} " + " and ".join(problems))


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


def _placement(cfg) -> Placement:
    policy = PrecisionPolicy.from_config(cfg)
    accel = get_accelerator()
    if not accel.supports_dtype(policy.compute):
        raise ValueError(f"{policy.compute} is not supported on this {accel.name} device; disable bf16/fp16")
    offload = OffloadPlan.from_config(cfg.zero_optimization, cfg.aio, comm.get_rank(), accel.can_pin_memory)
    if offload.on_nvme:
        bound_host_heap()  # before the model is materialized: nothing model-sized stays in glibc's heap
    return Placement(policy, accel.device(comm.backend.local_rank()), offload)


def _checkpointing_options(cfg) -> Optional[activation_checkpointing.CheckpointingOptions]:
    """The engine's activation-checkpointing options when its config has the block (in effect during its forward);
    None leaves what ``activation_checkpointing.configure`` set."""
    if not cfg.activation_checkpointing.model_fields_set:
        return None
    return activation_checkpointing.options_from(cfg.activation_checkpointing)


def _join_process_group(dist_init_required: Optional[bool]) -> None:
    if not comm.is_initialized():
        if dist_init_required is False:
            raise ValueError("dist_init_required=False but torch.distributed is not initialized")
        comm.init_distributed()
    comm.destroy_at_exit()  # also when the caller (Lightning, accelerate, a user) created the process group


def _resolve(
    source: Any, args: Any, model: torch.nn.Module, training_data: Any, mpu: Any
) -> tuple[comm.Mesh, Resolution]:
    """The rank mesh (the engine's process groups, counting in a comm context of its own, or refining the mesh a
    sequence-parallel registration built, in its context) and the config with every ``"auto"`` filled in for it."""
    parsed = parse_config(source)
    tp_size = tensor_parallel_size(model, parsed.tensor_parallel)
    sp_size, registered, sequence = _sequence_parallel(mpu, parsed)
    ep_size = expert_parallel_size(model, parsed.expert_parallel)
    pp_size = pipeline_stages(model, parsed, sp=sp_size)
    dims = comm.ParallelDims.for_world(
        comm.get_world_size(),
        tp=tp_size,
        sp=sp_size,
        shard_group_size=parsed.zero_optimization.shard_group_size,
        ep=ep_size,
        experts_span_tensor=parsed.expert_parallel.enabled,  # AutoEP routes the experts: it folds tp into ep
        pp=pp_size,
    )
    mesh = _engine_mesh(dims, registered, sequence)
    dataloader_batch = training_data.batch_size if isinstance(training_data, DataLoader) else None
    resolution = resolve_config(
        parsed,
        AutoContext(
            world_size=mesh.data_parallel_size,
            args=args,
            dataloader_batch_size=dataloader_batch,
            hidden_size=model_hidden_size(model),
            tensor_parallel_size=tp_size,
            sequence_parallel_size=sp_size,
        ),
    )
    check_same_batch_settings(
        resolution.batch.micro_batch_size, resolution.batch.gradient_accumulation_steps, mesh.world
    )
    stage = resolution.config.zero_optimization.stage
    axes = "".join(
        f" x {size} {name}-parallel" for name, size in (("sequence", sp_size), ("tensor", tp_size)) if size > 1
    )
    ranks = f"{mesh.data_parallel_size} data-parallel rank(s){axes}" if axes else f"{mesh.data_parallel_size} rank(s)"
    log_rank0(f"config resolved for {ranks}, ZeRO stage {stage}:\n" + resolution.report())
    return mesh, resolution


def _finish_parameters(model, materialize, placement: Placement, stack: ZeroStack, mesh, pieces) -> None:
    """Parameters outside the flat groups get data (zero.Init); the engine adopts every parameter with the ranks
    holding the same value of it (all of them, or under tensor / expert parallelism those holding the same piece), so
    ``GatheredParameters`` finds its flat group and its copies; under stage 3 every parameter answers DeepSpeed's
    ``ds_*`` attributes, resident and frozen ones too."""
    if materialize is not None:
        _finish_materialization(model, materialize, placement.device, placement.policy.compute)
    release_pending(model.parameters())  # also those a gather materialized before initialize (HF's loading)
    for param in model.parameters():
        split = pieces.get(param)
        group = mesh.piece_holders[split.axis] if split is not None else mesh.stage
        stack.records.adopt(param, whole=stack.stage3 is None, holders=group)


def _build_scheduler(lr_scheduler: Any, cfg, zero: Optional[ZeroOptimizer]):
    """The client's scheduler (or its ``optimizer -> scheduler`` callable), else the config's ``scheduler`` block."""
    if lr_scheduler is not None:
        if cfg.scheduler is not None:
            warnings.warn(
                "both lr_scheduler= and a 'scheduler' config block were given; using lr_scheduler=", stacklevel=3
            )
        if hasattr(lr_scheduler, "step"):
            return lr_scheduler
        if zero is None:
            raise ValueError(
                "lr_scheduler= is a callable (optimizer -> scheduler) but there is no optimizer to give it: pass "
                "optimizer= or add an 'optimizer' config block"
            )
        return lr_scheduler(zero.optimizer)
    if cfg.scheduler is not None and zero is not None:
        return build_schedule(cfg.scheduler.type, cfg.scheduler.params, zero.optimizer)
    return None


def _engine_class(plan: ParallelPlan):
    """The engine a model gets: a pipeline's (with its tie groups) when ``parallelize`` placed a pipeline."""
    if plan.pipeline is None:
        return ZeroshardEngine
    return functools.partial(PipelineEngine, ties=dict(plan.pipeline.groups))


def _build_dataloader(
    training_data, resolution: Resolution, mesh: comm.Mesh, collate_fn, plan: ParallelPlan
) -> Optional[DataLoader]:
    """A client DataLoader as it is; a Dataset gets zeroshard's resumable distributed sampler, shuffled (DeepSpeed's
    engine) or in order (a pipeline, as DeepSpeed's pipeline engine reads it: its clients rely on consecutive samples
    sharing a micro-batch)."""
    if training_data is None or isinstance(training_data, DataLoader):
        return training_data
    return distributed_loader(
        training_data,
        resolution.batch.micro_batch_size,
        mesh.batch.size,
        mesh.batch.rank,
        shuffle=plan.pipeline is None,
        drop_last=resolution.config.dataloader_drop_last,
        collate_fn=collate_fn,
    )


def _auto_resume(engine: ZeroshardEngine) -> None:
    """``checkpoint.auto_resume``: load the checkpoint ``latest`` names in ``checkpoint.save_dir`` (else the newest
    complete one there, see :mod:`zeroshard.checkpoint.resume`), so a restarted job (an elastic restart, a
    resubmitted one) continues where the last save left it; its ``client_state`` is ``engine.resumed_client_state``."""
    block = engine.settings.checkpoint
    if not block.auto_resume:
        return
    point = agree_on_resume_point(block.save_dir, engine.mesh.world)
    if point is None:
        log_rank0(f"auto_resume: no complete checkpoint in {block.save_dir} yet; starting from step 0")
        return
    path, client_state = engine.load_checkpoint(block.save_dir, tag=point.tag)
    engine.resumed_from, engine.resumed_client_state = path, client_state
    log_rank0(f"auto_resume: resumed from {path} at step {engine.global_steps} ({point.why})")


def _shard_model(model, optimizer, model_parameters, cfg, mesh, pretrained, units) -> tuple:
    """The model placed, split over the mesh's tensor and expert dimensions and sharded by the ZeRO stack over the
    optimizer the client gave or the config names (``units``: the extra gather-unit classes and leaf modules; a
    stack without an optimizer when neither names one); returns the stack, what ``parallelize`` did (each split
    parameter's split, a pipeline's ties), the placement (device, precision, offload) and how to build the stack
    again with an optimizer (``engine._configure_optimizer``)."""
    placement = _placement(cfg)
    materialize = _materializer(model, pretrained, mesh.world, placement.device)
    _move_module(model, placement.device, placement.policy)
    plan = parallelize(model, cfg, mesh, materialize)
    stack = _build_stack(model, optimizer, model_parameters, cfg, mesh, placement, materialize, units, plan)
    attach = functools.partial(_build_stack, model, cfg=cfg, mesh=mesh, placement=placement, materialize=None,
                               units=units, plan=plan)  # fmt: skip
    return stack, plan, placement, attach


def _build_stack(model, optimizer, model_parameters, cfg, mesh, placement, materialize, units, plan):
    """The ZeRO stack over ``model`` (placed by ``parallelize``: ``plan``) and the optimizer given or configured."""
    if optimizer is None and cfg.optimizer is None:
        stack = ZeroStack.without_optimizer(placement.device)
    else:
        param_groups, make_optimizer = optimizer_recipe(optimizer, model, model_parameters, cfg, placement.offload)
        stack = build_zero_stack(
            model=model,
            param_groups=param_groups,
            make_optimizer=make_optimizer,
            config=cfg,
            mesh=mesh,
            placement=placement,
            materialize=materialize,
            gather_unit_classes=units[0],
            leaf_modules=units[1],
            tensor_splits=plan.pieces,
            tied=plan.tied,
        )
    _finish_parameters(model, materialize, placement, stack, mesh, plan.pieces)
    return stack


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
    leaf_modules: Any = (),
    mpu: Any = None,
):
    """Build an engine; returns ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    ``optimizer`` and ``lr_scheduler`` may be objects or callables (``params -> optimizer``,
    ``optimizer -> scheduler``); otherwise they are built from the config's blocks by name.
    ``gather_unit_classes`` (module classes or class names) adds to ``zero_optimization.gather_unit_classes``:
    under stage 3 each module of those classes is one gather unit. ``leaf_modules`` (modules of ``model`` or their
    paths) adds to ``zero_optimization.leaf_module``: each is one gather unit with no unit inside it.
    ``pretrained`` (safetensors, a Hugging Face or zeroshard checkpoint) fills a model built under ``zero.Init``, one
    flat group at a time. ``mpu``: the mesh ``register_with_transformers`` built (the engine runs on it).
    ``train_batch_size`` counts the data-parallel ranks: world / (sequence x tensor parallel sizes).
    """
    if model is None:
        raise ValueError("initialize needs model=")
    refuse_experts_split_by_transformers(model)
    log_as_launched()
    source = _config_source(args, config if config is not None else config_params)
    _join_process_group(dist_init_required)
    mesh, resolution = _resolve(source, args, model, training_data, mpu)
    cfg = resolution.config
    if cfg.log_level is not None:  # DeepSpeed's log_level sets its logger's level; handlers stay the program's
        logger.setLevel(cfg.log_level.upper())
    units = (gather_unit_classes, leaf_modules)
    stack, plan, placement, attach = _shard_model(model, optimizer, model_parameters, cfg, mesh, pretrained, units)
    view = ZeroOptimizer(stack) if isinstance(stack, ZeroStack) else None  # the clients' torch.optim view of it
    scheduler = _build_scheduler(lr_scheduler, cfg, view)
    dataloader = _build_dataloader(training_data, resolution, mesh, collate_fn, plan)
    engine = _engine_class(plan)(
        model,
        stack=stack,
        lr_scheduler=scheduler,
        resolution=resolution,
        mesh=mesh,
        policy=placement.policy,
        device=placement.device,
        training_dataloader=dataloader,
        activation_checkpointing=_checkpointing_options(cfg),
        tensor_splits={name: plan.pieces[p] for name, p in model.named_parameters() if p in plan.pieces},
        optimizer=view,
        collate_fn=collate_fn,
        attach_optimizer=attach,
    )
    _auto_resume(engine)
    mesh.context.ledger.reset()  # the engine counts training traffic, not the initial weights or a resume
    return engine, view, dataloader, scheduler
