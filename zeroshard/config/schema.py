"""Typed schema of the DeepSpeed-compatible JSON config.

Field names and aliases follow DeepSpeed 0.19 so that an existing ``ds_config.json`` parses
unchanged. Values that may be ``"auto"`` stay ``"auto"`` here; :mod:`.resolve` replaces them.
"""

from __future__ import annotations

import math
import warnings
from enum import Enum
from pathlib import Path
from typing import Any, Literal, Optional, Union

from pydantic import Field, field_validator, model_validator

from .patterns import check_pattern
from .section import Section, refused, rename_deprecated, satisfied

Auto = Literal["auto"]
DTypeName = Literal["fp32", "fp16", "bf16"]


class FP16Config(Section):
    enabled: Union[bool, Auto] = False
    auto_cast: bool = satisfied(
        False, "floating-point inputs of the forward are always cast to the compute dtype (positional and keyword)"
    )
    loss_scale: float = Field(0.0, ge=0, description="0 selects dynamic loss scaling")
    initial_scale_power: int = Field(16, ge=0, le=64)
    loss_scale_window: int = Field(1000, gt=0)
    hysteresis: int = Field(2, ge=1)
    consecutive_hysteresis: bool = False
    min_loss_scale: float = Field(1.0, gt=0)
    fp16_master_weights_and_grads: bool = False


class BF16Config(Section):
    enabled: Union[bool, Auto] = False
    immediate_grad_update: bool = refused(True, "gradients are always reduced as they are produced")
    check_grad_overflow: bool = refused(True, "a step with non-finite gradients is always skipped")
    bf16_master_weights_and_grads: bool = refused(
        False,
        "ZeRO's master weights and gradients in bf16 without an fp32 copy: zeroshard keeps fp32 master weights "
        "(data_types.grad_accum_dtype 'bf16' keeps the gradient shards in bf16)",
    )
    bf16_optimizer_states: bool = refused(
        False, "optimizer states in bf16 (with bf16_master_weights_and_grads): zeroshard keeps them in fp32"
    )


class OffloadDevice(str, Enum):
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class _OffloadBase(Section):
    device: OffloadDevice = OffloadDevice.none
    nvme_path: Optional[Path] = None
    pin_memory: bool = False

    @field_validator("nvme_path", mode="before")
    @classmethod
    def _a_directory(cls, value: Any) -> Any:
        if isinstance(value, str) and not value.strip():  # Path("") is ".": the swap files would go to the cwd
            raise ValueError("nvme_path is empty: name the directory on a fast local disk to swap to")
        return value

    @model_validator(mode="after")
    def _nvme_needs_path(self):
        if self.device is OffloadDevice.nvme and self.nvme_path is None:
            raise ValueError("device 'nvme' needs 'nvme_path' (a directory on a fast local disk)")
        return self


# staging buffers an NVMe home keeps in host memory: more than a few dozen add no read-ahead, and each is allocated
# up front (a count of 10**9 filled host memory until the OOM killer ended the rank)
MAX_BUFFER_COUNT = 64


class OffloadParamConfig(_OffloadBase):
    buffer_count: int = Field(5, ge=1, le=MAX_BUFFER_COUNT)
    buffer_size: int = Field(100_000_000, ge=1)
    max_in_cpu: int = Field(1_000_000_000, ge=0)


class OffloadOptimizerConfig(_OffloadBase):
    buffer_count: int = Field(4, ge=1, le=MAX_BUFFER_COUNT)
    pipeline_read: bool = satisfied(False, "NVMe reads always run ahead of the sub-group being stepped")
    pipeline_write: bool = satisfied(False, "NVMe writes always run behind the sub-group being stepped")
    fast_init: bool = satisfied(False, "a start-up speed hint")
    # the share of the optimizer state offloaded (DeepSpeed's Twin-Flow); the rest stays on the compute device.
    # "auto" (zeroshard's): the largest share kept that fits keep_on_device_bytes, or the device's free memory
    ratio: Union[Auto, float] = 1.0
    keep_on_device_bytes: Optional[int] = Field(None, ge=0)  # ratio "auto": the device memory it may keep
    # the offloaded step during backward, exact (zeroshard.zero.speculation): True on, False off, None (the default)
    # on where it overlaps something: NVMe optimizer state, or CPU optimizer state beside an accelerator's compute
    super_offload: Optional[bool] = None
    cpuadam_cores_perc: float = Field(0.8, gt=0.0, le=1.0)  # the share of cores the step during backward uses
    speculation_host_bytes: Optional[int] = Field(None, ge=0)  # host memory for its shadows (cpu; None: no bound)

    @field_validator("ratio", mode="before")
    @classmethod
    def _a_share(cls, value: Any) -> Any:
        share = isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value <= 1.0
        if value != "auto" and not share:  # NaN compares false too
            raise ValueError(
                f"ratio={value!r}: the share of the optimizer state to offload, a number from 0 to 1, or 'auto'"
            )
        return value

    @model_validator(mode="after")
    def _speculation_needs_offload(self):
        if self.super_offload and self.device is OffloadDevice.none:
            raise ValueError(
                "super_offload: true needs the optimizer offloaded (device 'cpu' or 'nvme'): it steps the offloaded "
                "optimizer during backward; without offload the step runs on the device"
            )
        return self


ZEROPP_QUANTIZED = ("zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients")


class LeafModuleConfig(Section):
    """DeepSpeed's ``zero_optimization.leaf_module``: modules that are each one stage-3 gather unit (MoE blocks),
    by class name (or qualified name), module path, or path suffix."""

    classes: list[str] = Field(default_factory=list)
    names: list[str] = Field(default_factory=list)
    name_suffixes: list[str] = Field(default_factory=list)

    @field_validator("classes", "names", "name_suffixes", mode="before")
    @classmethod
    def _one_is_a_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value  # DeepSpeed takes a single name as a list of one


class ZeroConfig(Section):
    stage: int = Field(0, ge=0, le=3)
    contiguous_gradients: bool = satisfied(True, "gradients are always reduced from contiguous flat buffers")
    compute_grad_norm: bool = satisfied(
        True, "the global gradient norm is one 4-byte all-reduce that also detects overflow: it is always computed"
    )
    parameter_alignment: bool = refused(
        False,
        "padding stage 1-2 flat buffers so each parameter starts 16-byte aligned is not implemented (parameters are "
        "packed back to back)",
    )
    zenflow: Optional[dict[str, Any]] = refused(
        None,
        "ZenFlow (DeepSpeed 0.18: stall-free offload updating the top-k gradient columns on the device and the rest "
        "on the CPU behind) is not implemented; use offload_optimizer {'device': 'cpu'}, whose step runs behind the "
        "next forward",
    )
    reduce_scatter: bool = True
    reduce_bucket_size: Union[int, Auto] = Field(500_000_000)
    use_multi_rank_bucket_allreduce: bool = satisfied(True, "a performance hint; buckets are reduced in order")
    allgather_partitions: bool = satisfied(True, "updated shards are always all-gathered")
    allgather_bucket_size: Union[int, Auto] = Field(500_000_000)
    overlap_comm: Optional[bool] = None
    load_from_fp32_weights: bool = refused(True, "checkpoints always restore the fp32 master weights")
    elastic_checkpoint: bool = satisfied(False, "checkpoints always load on any world size and stage")
    offload_param: Optional[OffloadParamConfig] = None
    offload_optimizer: Optional[OffloadOptimizerConfig] = None
    sub_group_size: Union[int, Auto] = Field(1_000_000_000)
    save_muon_momentum_buffer_in_memory: bool = satisfied(
        False,
        "Muon's momentum lives with the rest of the optimizer state, on the device or with offload_optimizer 'cpu' in "
        "host memory (Muon with NVMe offload is refused)",
    )
    prefetch_bucket_size: Union[int, Auto] = Field(50_000_000, alias="stage3_prefetch_bucket_size")
    # zeroshard's: gather units prefetched ahead at most (within prefetch_bucket_size elements); one hides the
    # next unit's gather behind this one's compute, more only holds memory (docs/benchmarks.md "Stage-3 prefetch")
    prefetch_depth: int = Field(1, ge=0, le=1_000_000, alias="stage3_prefetch_depth")
    param_persistence_threshold: Union[int, Auto] = Field(100_000, alias="stage3_param_persistence_threshold")
    model_persistence_threshold: int = refused(
        2**63 - 1,
        "only stage3_param_persistence_threshold is implemented",
        ge=0,
        alias="stage3_model_persistence_threshold",
    )
    max_live_parameters: Union[int, Auto] = Field(1_000_000_000, alias="stage3_max_live_parameters")
    # a unit stays gathered after its forward when it is used again within this many elements of other units
    # (Note [reuse distance] in zero/stage3/schedule.py); zeroshard's default 0 keeps only the last unit of forward,
    # DeepSpeed's 1e9 (what "auto" gives) every unit of a model under about 5e8 parameters, as DeepSpeed does
    max_reuse_distance: Union[int, Auto] = Field(0, alias="stage3_max_reuse_distance")
    # zeroshard's: engine.train_batch() runs each gather unit over every micro-batch of the step before the next
    # unit (Note [layer-major] in zero/stage3/layer_major.py): one gather per unit in forward and one in backward per
    # step, one reduce-scatter, one read of an NVMe shard, however many micro-batches
    layer_major: bool = False
    gather_16bit_weights_on_model_save: bool = Field(False, alias="stage3_gather_16bit_weights_on_model_save")
    # stage 3: modules whose parameters per layer are at most this many are gathered as one unit (DeepSpeed's rule)
    module_granularity_threshold: int = Field(0, ge=0, alias="stage3_module_granularity_threshold")
    use_all_reduce_for_fetch_params: bool = refused(
        False, "parameters are gathered with all-gather", alias="stage3_use_all_reduce_for_fetch_params"
    )
    allgather_sequential: bool = refused(False, "not implemented", alias="stage3_allgather_sequential")
    ignore_unused_parameters: bool = True
    legacy_stage1: bool = refused(False, "the legacy stage 1 is not implemented")
    round_robin_gradients: bool = satisfied(False, "a CPU-offload performance hint; shards are already contiguous")
    zero_hpz_partition_size: int = Field(1, ge=1)
    zero_quantized_weights: bool = False  # ZeRO++ qwZ: stage 3 gathers parameters as int8
    zero_quantized_nontrainable_weights: bool = False  # frozen parameters kept and gathered as int8
    zero_quantized_gradients: bool = False  # ZeRO++ qgZ: stage 3 reduce-scatters gradients as int4
    zeropp_loco_param: Optional[dict[str, Any]] = refused(None, "ZeRO++ LoCo is not implemented yet")
    mics_shard_size: int = Field(-1, ge=-1)
    mics_hierarchical_params_gather: bool = refused(False, "hierarchical MiCS gathers are not implemented")
    memory_efficient_linear: bool = satisfied(True, "stage 3 frees gathered weights saved for backward already")
    pipeline_loading_checkpoint: bool = refused(False, "not implemented")
    override_module_apply: bool = refused(
        True, "module.apply is never overridden; under stage 3 use GatheredParameters around it"
    )
    log_trace_cache_warnings: bool = refused(False, "not implemented")
    enable_sanity_checks: bool = refused(False, "not implemented")
    gather_unit_classes: list[str] = Field(default_factory=list)
    gather_unit_min_params: Optional[int] = Field(None, ge=1)  # None: the model's repeated blocks
    leaf_module: LeafModuleConfig = Field(default_factory=LeafModuleConfig)

    @model_validator(mode="before")
    @classmethod
    def _deprecated_keys(cls, values: Any) -> Any:
        values = rename_deprecated(
            values, "stage3_gather_fp16_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save"
        )
        if not isinstance(values, dict):
            return values
        values = dict(values)
        pin = values.pop("cpu_offload_use_pin_memory", None)
        for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
            if old not in values:
                continue
            enabled = values.pop(old)
            if not isinstance(enabled, bool):
                raise ValueError(f"'{old}' must be true or false, got {enabled!r}")
            warnings.warn(
                f"config key '{old}' is deprecated; use '{new}': {{\"device\": \"cpu\"}}", FutureWarning, stacklevel=2
            )
            if enabled:
                if values.get(new) is not None:
                    raise ValueError(f"both deprecated '{old}' and '{new}' are set; keep only '{new}'")
                values[new] = {"device": "cpu", "pin_memory": bool(pin)}
        return values

    @field_validator(
        "reduce_bucket_size",
        "allgather_bucket_size",
        "prefetch_bucket_size",
        "param_persistence_threshold",
        "max_live_parameters",
        "max_reuse_distance",
        "sub_group_size",
    )
    @classmethod
    def _at_least(cls, value, info):
        low = 1 if info.field_name == "sub_group_size" else 0  # sizes of things, counts of elements
        if value != "auto" and value < low:
            raise ValueError(f"must be >= {low}")
        return value

    @model_validator(mode="after")
    def _offload_param_needs_stage3(self):
        if self.offload_param is not None and self.offload_param.device is not OffloadDevice.none and self.stage != 3:
            # Accelerate's plugin writes it for every stage; DeepSpeed accepts it and ignores it below stage 3
            warnings.warn(
                f"zero_optimization.offload_param has no effect at stage {self.stage} (parameters are sharded and "
                "offloaded only at stage 3); it is ignored. Use offload_optimizer for stages 1 and 2",
                UserWarning,
                stacklevel=2,
            )
            self.offload_param = None
        if self.offload_optimizer is not None and self.offload_optimizer.device is not OffloadDevice.none:
            if self.stage == 0:
                raise ValueError("offload_optimizer needs a sharded optimizer: set stage to 1, 2 or 3")
        if self.layer_major and self.stage != 3:
            raise ValueError(
                f"layer_major schedules stage 3's gather units over a step's micro-batches; it needs stage 3 (stage is "
                f"{self.stage}), where each micro-batch would otherwise gather every unit again"
            )
        if self.zero_hpz_partition_size > 1 and self.mics_shard_size > 0:
            raise ValueError("set either zero_hpz_partition_size or mics_shard_size, not both")
        quantized = [k for k in ZEROPP_QUANTIZED if getattr(self, k)]
        if quantized and self.stage != 3:
            raise ValueError(
                f"{quantized[0]} quantizes stage 3's parameter gathers and gradient reduce-scatters; it needs "
                f"stage 3 (stage is {self.stage})"
            )
        offloaded = self.offload_param is not None and self.offload_param.device is not OffloadDevice.none
        if self.zero_quantized_nontrainable_weights and offloaded:
            raise ValueError(
                "zero_quantized_nontrainable_weights keeps frozen parameters as int8 on the device; it cannot be "
                "combined with offload_param (drop one)"
            )
        return self

    @property
    def shard_group_size(self) -> Optional[int]:
        """Hybrid-sharding group size requested by the config, if any."""
        if self.zero_hpz_partition_size > 1:
            return self.zero_hpz_partition_size
        if self.mics_shard_size > 0:
            return self.mics_shard_size
        return None


class OptimizerConfig(Section):
    type: str
    params: dict[str, Any] = Field(default_factory=dict)
    legacy_fusion: bool = refused(False, "not implemented")


class SchedulerConfig(Section):
    type: str
    params: dict[str, Any] = Field(default_factory=dict)


class CommsLoggerConfig(Section):
    enabled: bool = False
    verbose: bool = False  # rank 0 prints every timed collective as it completes
    prof_all: bool = refused(True, "every op is counted")
    debug: bool = False  # the totals are also split by the call site that issued each collective
    prof_ops: list[str] = refused([], "every op is counted")


class ActivationCheckpointingConfig(Section):
    """Options of ``zeroshard.runtime.activation_checkpointing`` (DeepSpeed's ``deepspeed.checkpointing``): a block
    given here is the engine's, in effect while its forward runs; ``configure(deepspeed_config=...)`` reads it too."""

    partition_activations: bool = False
    contiguous_memory_optimization: bool = satisfied(
        False, "checkpointed activations stay in the blocks torch's caching allocator reuses step after step"
    )
    cpu_checkpointing: bool = False
    number_checkpoints: Optional[int] = Field(None, ge=1)
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


class AioConfig(Section):
    block_size: int = Field(1_048_576, gt=0)
    queue_depth: int = Field(8, gt=0)
    intra_op_parallelism: int = Field(1, ge=1)
    single_submit: bool = False
    overlap_events: bool = satisfied(True, "reads and writes always overlap the optimizer step")
    use_gds: bool = refused(False, "GPUDirect Storage is not supported")
    # zeroshard's: every swap-file read is checked against a checksum of what was written there (Note [swap
    # checksums] in offload/aio.py; off by default: it cost 3-4% of the NVMe step here, above the 2% bar)
    verify_reads: bool = False

    @model_validator(mode="before")
    @classmethod
    def _thread_count(cls, values: Any) -> Any:
        return rename_deprecated(values, "thread_count", "intra_op_parallelism")


class CheckpointConfig(Section):
    tag_validation: Literal["Ignore", "Warn", "Fail", "ignore", "warn", "fail", "IGNORE", "WARN", "FAIL"] = "Warn"
    checkpoint_serialization: bool = satisfied(True, "checkpoints are safetensors and JSON, never pickles")
    writer: Optional[dict[str, Any]] = refused(
        None,
        "FastPersist (DeepSpeed's checkpoint writer: O_DIRECT double buffers, io_multiplier, writers per replica, "
        "socket or machine) is not implemented; every rank writes its own safetensors file in parallel, atomically",
    )
    # load_checkpoint's tag defaults to 'latest_universal' (also written by save_checkpoint), which may name a
    # DeepSpeed universal folder (zeroshard.checkpoint.deepspeed_universal) or a zeroshard checkpoint
    load_universal: bool = False
    use_node_local_storage: bool = refused(False, "not implemented")
    parallel_write: dict[str, Any] = refused({}, "every rank always writes its own file in parallel")
    # zeroshard's own: resuming as the default path (elastic restarts pick up the newest checkpoint)
    save_dir: Optional[str] = None  # where periodic saves go and auto_resume looks
    save_interval_steps: int = Field(0, ge=0)  # save every N optimizer steps (0: only when the script saves)
    auto_resume: bool = False  # initialize loads save_dir's 'latest' when there is one

    @model_validator(mode="after")
    def _needs_a_directory(self) -> "CheckpointConfig":
        if (self.save_interval_steps or self.auto_resume) and not self.save_dir:
            used = "save_interval_steps" if self.save_interval_steps else "auto_resume"
            raise ValueError(f"checkpoint.{used} needs checkpoint.save_dir (the directory to save to / resume from)")
        return self


class ElasticityConfig(Section):
    """DeepSpeed's elastic batch (see ``zeroshard.config.elasticity``); DeepSpeed's defaults."""

    enabled: bool = False
    max_train_batch_size: int = Field(2000, ge=1, le=10**8)  # the search holds one counter per batch size
    micro_batch_sizes: list[int] = Field(default_factory=lambda: [2, 4, 6])
    min_gpus: int = Field(1, ge=1)
    max_gpus: int = Field(10000, ge=1)
    min_time: int = satisfied(
        20, "minutes a scale should run before a job scheduler rescales it; DeepSpeed's runtime does not read it", ge=0
    )
    version: float = 0.2
    prefer_larger_batch: bool = True
    ignore_non_elastic_batch_info: bool = False
    model_parallel_size: int = refused(1, "elastic model parallelism is not implemented")
    num_gpus_per_node: int = Field(1, ge=1)  # version 0.2: world sizes are whole nodes

    @field_validator("micro_batch_sizes", mode="before")
    @classmethod
    def _positive_micro(cls, value: Any) -> Any:
        if (
            not isinstance(value, list)
            or not value
            or any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in value)
        ):
            raise ValueError(f"elasticity.micro_batch_sizes must be a list of positive integers, got {value!r}")
        return value

    @field_validator("version")
    @classmethod
    def _known_version(cls, value: float) -> float:
        if value not in (0.1, 0.2):
            raise ValueError(f"elasticity.version must be 0.1 or 0.2, got {value}")
        return value


class MonitorConfig(Section):
    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"

    @field_validator("job_name")
    @classmethod
    def _plain_job_name(cls, value: str) -> str:
        # the monitor writes under output_path/job_name: a name with a path in it would write elsewhere
        if not value or value in (".", "..") or any(c in value for c in "/\\\0"):
            raise ValueError("must be a plain name (a directory under output_path): no '/', '\\', '..' or NUL")
        return value


class WandbConfig(Section):
    """DeepSpeed's ``wandb`` monitor block (``zeroshard.runtime.monitor.WandbMonitor``)."""

    enabled: bool = False
    group: Optional[str] = None
    team: Optional[str] = None
    project: str = "deepspeed"


class CometConfig(Section):
    """DeepSpeed's ``comet`` monitor block (``zeroshard.runtime.monitor.CometMonitor``)."""

    enabled: bool = False
    samples_log_interval: int = Field(100, ge=1)
    project: Optional[str] = None
    workspace: Optional[str] = None
    api_key: Optional[str] = None
    experiment_name: Optional[str] = None
    experiment_key: Optional[str] = None
    online: Optional[bool] = None
    mode: Optional[str] = None


_DEEPCOMPILE = "a DeepCompile option (compiler passes for ZeRO), not implemented"


class CompileConfig(Section):
    """DeepSpeed's ``compile`` block. The engine compiles only when ``engine.compile()`` is called (as DeepSpeed):
    ``backend`` and ``kwargs`` are what that call uses when it names none, and ``disable: true`` makes it a no-op."""

    disable: bool = False
    backend: str = "inductor"
    kwargs: dict[str, Any] = Field(default_factory=dict)
    deepcompile: bool = refused(False, "DeepCompile (compiler passes for ZeRO) is not implemented")
    autoep_non_moe: bool = refused(
        False, "compiling the parents of AutoEP layers apart is not implemented; engine.compile() compiles the module"
    )
    # DeepCompile's options (DeepSpeed reads them only with deepcompile: true)
    free_activation: bool = refused(False, _DEEPCOMPILE)
    free_activation_threshold: int = refused(10 * 1024 * 1024, _DEEPCOMPILE)
    offload_activation: bool = refused(False, _DEEPCOMPILE)
    offload_activation_pin_memory: bool = refused(True, _DEEPCOMPILE)
    offload_opt_states: bool = refused(False, _DEEPCOMPILE)
    offload_parameters: bool = refused(False, _DEEPCOMPILE)
    double_buffer: bool = refused(True, _DEEPCOMPILE)
    symmetric_memory: bool = refused(False, _DEEPCOMPILE)
    debug_log: bool = refused(False, _DEEPCOMPILE)
    sync_before_reduce: bool = refused(False, _DEEPCOMPILE)
    sync_after_reduce: bool = refused(False, _DEEPCOMPILE)
    sync_before_allgather: bool = refused(False, _DEEPCOMPILE)
    sync_after_allgather: bool = refused(False, _DEEPCOMPILE)
    keep_int_input_tensors: bool = refused(True, _DEEPCOMPILE)
    keep_all_input_tensors: bool = refused(False, _DEEPCOMPILE)
    passes: Optional[list[str]] = refused(None, _DEEPCOMPILE)


class PipelineConfig(Section):
    """DeepSpeed's ``pipeline`` block, read when the model is a ``PipelineModule`` (the module's own arguments decide
    its stages and partition, as in DeepSpeed). ``stages`` must match the module's; ``activation_checkpoint_interval``
    > 0 sets the module's; ``use_reentrant: false`` makes its checkpoint function torch's non-reentrant one (the
    default of zeroshard's ``PipelineModule`` already). ``pipe_partitioned`` / ``grad_partitioned`` cut activations
    and gradients over a tensor-parallel group, which pipelines here do not have: no effect."""

    stages: Optional[int] = None  # "auto" (DeepSpeed's default): the module's
    partition: str = "best"
    seed_layers: bool = False
    activation_checkpoint_interval: int = Field(0, ge=0)
    pipe_partitioned: bool = satisfied(True, "activations are split only over a tensor-parallel group (none here)")
    grad_partitioned: bool = satisfied(True, "gradients are split only over a tensor-parallel group (none here)")
    use_reentrant: Optional[bool] = None
    # zeroshard's: the most the activations one micro-batch sends to the next stage may take (None: a quarter of the
    # device's memory); a receiving stage refuses an announcement above it before allocating anything
    max_activation_bytes: Optional[int] = Field(None, ge=1)

    @field_validator("stages", mode="before")
    @classmethod
    def _stages(cls, value):
        if value == "auto":
            return None
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise ValueError("must be 'auto' or a positive integer")
        return value


class TensorParallelLayerSpec(Section):
    """One ``tensor_parallel.partition_config.layer_specs`` entry (DeepSpeed's ``TPLayerSpec``): the modules whose
    name (or ``<name>.weight``) a pattern matches are split as ``partition_type`` (``skip``: replicated)."""

    patterns: list[str] = Field(min_length=1)
    partition_type: Literal["column", "row", "skip"] = "column"
    shape: Optional[list[Any]] = None  # [k, -1] with partition_dim 0: k equal projections fused along dim 0
    partition_dim: Optional[int] = Field(None, ge=0)
    model_types: Optional[list[str]] = None
    gather_output: bool = refused(False, "column layers with a gathered output; an LM head stays replicated")
    grad_allreduce: bool = False

    @field_validator("partition_type", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @field_validator("patterns")
    @classmethod
    def _compiles(cls, patterns: list[str]) -> list[str]:
        for pattern in patterns:
            check_pattern(pattern)  # compiles, and cannot take long on a module name (zeroshard.config.patterns)
        return patterns

    @model_validator(mode="after")
    def _supported(self) -> "TensorParallelLayerSpec":
        if self.grad_allreduce and self.partition_type != "skip":
            raise ValueError("grad_allreduce applies to partition_type 'skip' (a replicated module) only")
        default_dim = 0 if self.partition_type == "column" else 1
        if self.partition_type != "skip" and self.partition_dim not in (None, default_dim):
            raise NotImplementedError(
                f"layer_specs {self.patterns}: partition_dim {self.partition_dim} for a {self.partition_type} layer is "
                f"not implemented (a {self.partition_type} layer splits dim {default_dim} of its weight)"
            )
        if self.shape is not None and not self._fused_shape():
            raise NotImplementedError(
                f"layer_specs {self.patterns}: shape {self.shape} is not implemented; zeroshard takes [k, -1] on a "
                "column layer (k equal projections fused along dim 0)"
            )
        return self

    def _fused_shape(self) -> bool:
        shape = self.shape
        return (
            self.partition_type == "column"
            and len(shape) == 2
            and isinstance(shape[0], int)
            and not isinstance(shape[0], bool)
            and shape[0] >= 1
            and shape[1] == -1
        )

    @property
    def fused(self) -> int:
        return self.shape[0] if self.shape is not None else 1


class TensorParallelPartitionConfig(Section):
    """``tensor_parallel.partition_config``: layer specs first; with ``use_default_specs`` the model's own
    ``base_model_tp_plan`` and zeroshard's placement by layer name place the layers no spec matches."""

    use_default_specs: bool = True
    layer_specs: list[TensorParallelLayerSpec] = Field(default_factory=list)


class TensorParallelGroupConfig(Section):
    """DeepSpeed's ``tensor_parallel.tp`` block."""

    tp_size: int = Field(1, ge=1)
    tp_grain_size: int = refused(1, "uneven splits; every split here is even", ge=1)


PRESET_MODELS = ("llama", "qwen2")  # DeepSpeed's presets zeroshard has (zeroshard.tensor_parallel.placement.PRESETS)


class TensorParallelTrainingConfig(Section):
    """DeepSpeed's AutoTP training block (``zeroshard.tensor_parallel``); OpenRLHF always writes it (0 or 1: off)."""

    autotp_size: int = Field(1, ge=0)
    preset_model: Optional[str] = None
    partition_config: TensorParallelPartitionConfig = Field(default_factory=TensorParallelPartitionConfig)
    tp_overlap_comm: bool = satisfied(
        False, "a scheduling hint: the tensor-parallel all-reduces run in order, with the same results"
    )
    tp: TensorParallelGroupConfig = Field(default_factory=TensorParallelGroupConfig, alias="tensor_parallel")
    dtype: Optional[DTypeName] = satisfied(
        None, "the model's dtype comes from the bf16 / fp16 blocks (DeepSpeed reads it to check tp_model_init's)"
    )
    replace_with_kernel_inject: bool = refused(
        False,
        "DeepSpeed's CUDA inference kernels: zeroshard has none (AutoTP splits layers with torch ops)",
        alias="kernel_inject",
    )
    vocab_parallel_ce_backend: Literal["torch", "liger"] = refused(
        "torch", "Liger's cross-entropy over a vocabulary-parallel LM head (the head stays replicated in training)"
    )
    vocab_parallel_lm_head: Optional[bool] = None  # None and False: replicated, as zeroshard always keeps it
    injection_policy_tuple: Optional[list[Any]] = refused(None, "use partition_config.layer_specs")
    keep_module_on_host: bool = refused(False, "keeping the unsharded model on the host")

    @field_validator("autotp_size", mode="before")
    @classmethod
    def _zero_is_off(cls, value: Any) -> Any:
        return 1 if value == 0 and not isinstance(value, bool) else value

    @field_validator("preset_model")
    @classmethod
    def _known_preset(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and value.lower() not in PRESET_MODELS:
            raise NotImplementedError(
                f"config key 'tensor_parallel.preset_model' = {value!r} is not implemented by zeroshard (it has "
                f"{list(PRESET_MODELS)}; other models take partition_config.layer_specs or the default placement)"
            )
        return value

    @model_validator(mode="after")
    def _sizes_agree(self) -> "TensorParallelTrainingConfig":
        if self.vocab_parallel_lm_head:
            raise NotImplementedError(
                "config key 'tensor_parallel.vocab_parallel_lm_head' = True is not implemented by zeroshard (in "
                "training the embedding and LM head stay replicated); remove the key or set it to false"
            )
        if self.tp.tp_size not in (1, self.autotp_size):
            raise ValueError(
                f"tensor_parallel.tp.tp_size {self.tp.tp_size} disagrees with tensor_parallel.autotp_size "
                f"{self.autotp_size}; set autotp_size (tp.tp_size may be left out)"
            )
        return self


EXPERT_PRESETS = ("mixtral", "qwen3_moe")  # DeepSpeed's AutoEP presets zeroshard has (zeroshard.moe.PRESETS)


class ExpertParallelConfig(Section):
    """DeepSpeed's AutoEP block (``zeroshard.moe``): the fused experts of a Hugging Face MoE model are split over
    expert groups of ``autoep_size`` consecutive ranks (with ``tensor_parallel.autotp_size``, DeepSpeed's folding:
    the group takes in tensor ranks, each routing its block of the tokens they share). Off unless
    ``"enabled": true``."""

    enabled: bool = False
    autoep_size: int = Field(1, ge=1)
    preset_model: Optional[str] = None
    use_grouped_mm: bool = satisfied(True, "a kernel choice: the experts' matrix products give the same values")
    disable_triton_grouped_mm: bool = satisfied(False, "a kernel choice: no Triton kernel is used")
    expert_tensor_parallel_size: int = refused(
        1,
        "experts cut by tensor parallelism inside each expert (DeepSpeed 0.19 reserves the key and refuses values "
        "above 1 as well); with tensor_parallel.autotp_size the expert group takes in the tensor ranks instead, "
        "each holding whole experts of its own (expert tensor parallelism 1)",
        ge=1,
    )
    load_balance_coeff: Optional[float] = refused(None, "auxiliary-loss-free load balancing (expert bias)")
    moe_layer_pattern: Optional[str] = refused(None, "custom layer patterns; fused experts are found by layout")
    expert_pattern: Optional[str] = refused(None, "custom expert patterns; fused experts are found by layout")
    router_pattern: Optional[str] = refused(None, "custom router patterns; the model's own router routes")

    @field_validator("preset_model")
    @classmethod
    def _known_preset(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and value not in EXPERT_PRESETS:
            raise NotImplementedError(
                f"config key 'expert_parallel.preset_model' = {value!r} is not implemented by zeroshard (it has "
                f"{list(EXPERT_PRESETS)}; other models with fused experts need no preset)"
            )
        return value


class FlopsProfilerConfig(Section):
    """DeepSpeed's ``flops_profiler`` block: rank 0 profiles the forward of step ``profile_step`` (counted in
    optimizer steps taken before it, as DeepSpeed counts) and prints it after that step."""

    enabled: bool = False
    recompute_fwd_factor: float = Field(0.0, ge=0.0, le=1.0)
    profile_step: int = Field(1, ge=1)
    module_depth: int = Field(-1, ge=-1)
    top_modules: int = Field(1, ge=1)
    detailed: bool = True
    output_file: Optional[str] = None


class DataTypesConfig(Section):
    """DeepSpeed's ``data_types`` block. ``param_dtype`` must agree with the precision the fp16 / bf16 blocks select
    (DeepSpeed checks the same); ``buffer_dtype`` casts floating buffers (unset: each keeps its dtype);
    ``keep_in_fp32_modules`` names the buffers kept in fp32 under bf16 / fp16 (``zeroshard.precision.fp32_buffers``)."""

    grad_accum_dtype: Optional[DTypeName] = None
    param_dtype: Optional[DTypeName] = None
    buffer_dtype: Optional[DTypeName] = None
    keep_in_fp32_modules: Union[Literal["auto"], list[str]] = "auto"

    @field_validator("keep_in_fp32_modules")
    @classmethod
    def _patterns(cls, value: Any) -> Any:
        if value == "auto":
            return value
        if len(value) > MAX_FP32_PATTERNS:
            raise ValueError(f"at most {MAX_FP32_PATTERNS} patterns, got {len(value)}")
        for pattern in value:
            if not pattern or len(pattern) > 512 or "\0" in pattern:
                raise ValueError(
                    f"each pattern is a name of 1 to 512 characters ('*': any characters), got {pattern!r}"
                )
        return value


MAX_FP32_PATTERNS = 1024  # every buffer name is matched against each


# DeepSpeed feature blocks we parse but do not implement: accepted when absent or disabled, refused when enabled.
# Each maps to what an absent ``enabled`` means in DeepSpeed (its AutoEP and torch_autocast blocks are off unless
# ``"enabled": true``; the others are on when present).
UNSUPPORTED_FEATURE_BLOCKS = {
    "autotuning": True,
    "data_efficiency": True,
    "hybrid_engine": True,
    "weight_quantization": True,
    "datastates_ckpt": True,
    "torch_autocast": False,
}
# Feature blocks DeepSpeed 0.19 removed (its config reader refuses them): refused with that reason unless
# written ``"enabled": false`` (then harmless: a warning names them). Elasticity and MiCS, which zeroshard keeps,
# are not among them.
REMOVED_IN_DEEPSPEED = {
    "amp": "NVIDIA Apex AMP (use 'fp16' or 'bf16')",
    "compression_training": "the compression library",
    "curriculum_learning": "top-level curriculum learning (DeepSpeed moved it under data_efficiency)",
    "eigenvalue": "eigenvalue-based MoQ",
    "nebula": "Nebula checkpointing",
    "progressive_layer_drop": "progressive layer dropping",
    "quantize_training": "Mixture-of-Quantization",
    "sparse_attention": "Sparse Attention",
}


MAX_BATCH = 2**31 - 1  # samples in a batch: beyond a sampler's index range


class GradientCheckConfig(Section):
    """zeroshard's own (DeepSpeed has none): check at the step that the gradient reduction summed every rank's
    gradient and divided by the group size, from random projections (``zeroshard/zero/gradient_check.py``). One
    small all-reduce per checked step; ``interval`` checks every N-th optimizer step."""

    enabled: bool = False
    interval: int = Field(1, ge=1)
    projections: int = Field(2, ge=1, le=16)  # random directions per flat group: more make a miss less likely
    seed: int = Field(0, ge=0)


class ZeroshardConfig(Section):
    train_batch_size: Union[int, Auto, None] = Field(None)
    train_micro_batch_size_per_gpu: Union[int, Auto, None] = Field(None)
    gradient_accumulation_steps: Union[int, Auto, None] = Field(None)
    steps_per_print: Optional[int] = Field(10, ge=1)
    # DeepSpeed's default since its PR #8068 (0.19.x): clip the global gradient norm at 1.0; 0 disables
    gradient_clipping: Union[float, Auto] = 1.0
    # zeroshard's own: stop after this many optimizer steps in a row were skipped for non-finite gradients
    # without a dynamic fp16 loss scale to recover them (fp32/bf16, or a static fp16 scale); 0 never stops
    max_consecutive_skipped_steps: int = Field(20, ge=0)
    prescale_gradients: bool = refused(False, "gradients are divided by the world size after the reduction")
    gradient_allreduce_op: Literal["mean", "sum"] = refused(
        "mean", "gradients are averaged over the data-parallel ranks; summing them is not implemented"
    )
    managed_gradient_accumulation: bool = refused(
        True, "the engine always accumulates gradients itself between optimizer steps"
    )
    disable_python_gc: Union[bool, int] = refused(False, "Python's garbage collector is left as the program set it")
    graph_harvesting: bool = refused(False, "DeepSpeed 0.19 removed graph harvesting")
    use_data_before_expert_parallelism: bool = refused(
        False, "expert-data groups are laid out as DeepSpeed's default (ranks ep apart); the other layout is not built"
    )
    vocabulary_size: Optional[int] = refused(None, "DeepSpeed only warns with it about tensor-core alignment")
    # DeepSpeed's logger level (DEBUG, INFO, ...): sets the level of the 'zeroshard' logger at initialize
    log_level: Optional[Literal["debug", "info", "warning", "error", "critical"]] = None
    timers: Optional[dict[str, Any]] = satisfied(
        None, "DeepSpeed's throughput timer only prints; zeroshard's step summary needs no timer switched on"
    )
    gradient_predivide_factor: float = Field(1.0, gt=0)
    communication_data_type: Optional[DTypeName] = None
    # with sequence_parallel_size > 1 DeepSpeed reduces gradients in this dtype instead (default fp32)
    seq_parallel_communication_data_type: DTypeName = "fp32"
    fp16: FP16Config = Field(default_factory=FP16Config)
    bf16: BF16Config = Field(default_factory=BF16Config, alias="bfloat16")
    optimizer: Optional[OptimizerConfig] = None
    scheduler: Optional[SchedulerConfig] = None
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    zero_allow_untested_optimizer: bool = False
    zero_force_ds_cpu_optimizer: bool = True
    wall_clock_breakdown: bool = False
    memory_breakdown: bool = False
    dump_state: bool = refused(False, "not implemented")
    sparse_gradients: bool = refused(False, "DeepSpeed 0.19 removed sparse embedding-gradient compression")
    disable_allgather: bool = refused(False, "not implemented")
    dataloader_drop_last: bool = False
    comms_logger: CommsLoggerConfig = Field(default_factory=CommsLoggerConfig)
    activation_checkpointing: ActivationCheckpointingConfig = Field(default_factory=ActivationCheckpointingConfig)
    aio: AioConfig = Field(default_factory=AioConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig)
    tensorboard: MonitorConfig = Field(default_factory=MonitorConfig)
    csv_monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    comet: CometConfig = Field(default_factory=CometConfig)
    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig)
    elasticity: ElasticityConfig = Field(default_factory=ElasticityConfig)
    autotuning: Optional[dict[str, Any]] = None
    compression_training: Optional[dict[str, Any]] = None
    data_efficiency: Optional[dict[str, Any]] = None
    curriculum_learning: Optional[dict[str, Any]] = None
    sparse_attention: Optional[dict[str, Any]] = None
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    amp: Optional[dict[str, Any]] = None
    progressive_layer_drop: Optional[dict[str, Any]] = None
    eigenvalue: Optional[dict[str, Any]] = None
    quantize_training: Optional[dict[str, Any]] = None
    hybrid_engine: Optional[dict[str, Any]] = None
    datastates_ckpt: Optional[dict[str, Any]] = None
    expert_parallel: ExpertParallelConfig = Field(default_factory=ExpertParallelConfig)
    torch_autocast: Optional[dict[str, Any]] = None
    compile: CompileConfig = Field(default_factory=CompileConfig)
    tensor_parallel: TensorParallelTrainingConfig = Field(default_factory=TensorParallelTrainingConfig)
    # Ulysses: the ranks of a sequence-parallel group split each sample's tokens (zeroshard.sequence_parallel)
    sequence_parallel_size: int = Field(1, ge=1)
    gradient_check: GradientCheckConfig = Field(default_factory=GradientCheckConfig)
    nebula: Optional[dict[str, Any]] = None
    weight_quantization: Optional[dict[str, Any]] = None

    @model_validator(mode="before")
    @classmethod
    def _steps_per_print_infinity(cls, values: Any) -> Any:
        # accelerate writes Infinity, meaning "never"; any other non-finite number is refused
        if isinstance(values, dict) and values.get("steps_per_print") == math.inf:
            values = {**values, "steps_per_print": None}
        return values

    @field_validator("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", mode="before")
    @classmethod
    def _whole_float(cls, value):
        # ArcticTraining writes train_batch_size as a float (32.0): a whole number is that integer
        if isinstance(value, float) and math.isfinite(value) and value == int(value):
            return int(value)
        return value

    @field_validator("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    @classmethod
    def _positive(cls, value):
        if isinstance(value, int) and value < 1:
            raise ValueError("must be a positive integer")
        if isinstance(value, int) and value > MAX_BATCH:
            raise ValueError(f"is larger than any batch a data loader can draw (at most {MAX_BATCH})")
        return value

    @field_validator("gradient_allreduce_op", "log_level", mode="before")
    @classmethod
    def _lower_case(cls, value):
        return value.lower() if isinstance(value, str) else value  # as DeepSpeed reads them

    @field_validator("gradient_clipping")
    @classmethod
    def _clip_non_negative(cls, value):
        if value != "auto" and value < 0:
            raise ValueError("must be >= 0 (0 disables clipping)")
        return value

    @field_validator("zero_optimization", mode="before")
    @classmethod
    def _legacy_bool(cls, value):
        # DeepSpeed's oldest format: "zero_optimization": true meant stage 1.
        if isinstance(value, bool):
            warnings.warn(
                "'zero_optimization': true/false is deprecated; use {\"stage\": N}", FutureWarning, stacklevel=2
            )
            return {"stage": 1 if value else 0}
        return value

    @model_validator(mode="after")
    def _one_precision(self):
        if self.fp16.enabled is True and self.bf16.enabled is True:
            raise ValueError("fp16.enabled and bf16.enabled are both true; enable at most one")
        return self

    @model_validator(mode="after")
    def _muon_offload(self):
        """DeepSpeed's rule at stages 1-2 (its ValueError, its words): Muon with the optimizer offloaded needs
        ``reduce_scatter: false``."""
        z = self.zero_optimization
        offloaded = z.offload_optimizer is not None and z.offload_optimizer.device is not OffloadDevice.none
        muon = self.optimizer is not None and self.optimizer.type.lower() == "muon"
        if muon and offloaded and z.stage in (1, 2) and z.reduce_scatter:
            raise ValueError(
                "Muon with reduce scatter does not support optimizer offload because offload retains only partition "
                "slices; disable reduce scatter (zero_optimization.reduce_scatter: false) or optimizer offload"
            )
        return self
