"""Typed schema of the DeepSpeed-compatible JSON config.

Field names and aliases follow DeepSpeed 0.19 so that an existing ``ds_config.json`` parses
unchanged. Values that may be ``"auto"`` stay ``"auto"`` here; :mod:`.resolve` replaces them.
"""

from __future__ import annotations

import warnings
from enum import Enum
from pathlib import Path
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Auto = Literal["auto"]
DTypeName = Literal["fp32", "fp16", "bf16"]


class Section(BaseModel):
    """Every config section rejects unknown keys and accepts both field names and DeepSpeed aliases."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


def _rename_deprecated(values: Any, old: str, new: str) -> Any:
    """Move a deprecated key to its new name, refusing a conflicting value under both names."""
    if not isinstance(values, dict) or old not in values:
        return values
    values = dict(values)
    value = values.pop(old)
    if new in values and values[new] != value:
        raise ValueError(f"'{old}' (deprecated) and '{new}' disagree ({value!r} vs {values[new]!r}); keep only '{new}'")
    warnings.warn(f"config key '{old}' is deprecated; use '{new}'", FutureWarning, stacklevel=2)
    values[new] = value
    return values


class FP16Config(Section):
    enabled: Union[bool, Auto] = False
    auto_cast: bool = False
    loss_scale: float = Field(0.0, ge=0, description="0 selects dynamic loss scaling")
    initial_scale_power: int = Field(16, ge=0, le=64)
    loss_scale_window: int = Field(1000, gt=0)
    hysteresis: int = Field(2, ge=1)
    consecutive_hysteresis: bool = False
    min_loss_scale: float = Field(1.0, gt=0)
    fp16_master_weights_and_grads: bool = False


class BF16Config(Section):
    enabled: Union[bool, Auto] = False
    immediate_grad_update: bool = True
    check_grad_overflow: bool = False


class OffloadDevice(str, Enum):
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class _OffloadBase(Section):
    device: OffloadDevice = OffloadDevice.none
    nvme_path: Optional[Path] = None
    pin_memory: bool = False

    @model_validator(mode="after")
    def _nvme_needs_path(self):
        if self.device is OffloadDevice.nvme and self.nvme_path is None:
            raise ValueError("device 'nvme' needs 'nvme_path' (a directory on a fast local disk)")
        return self


class OffloadParamConfig(_OffloadBase):
    buffer_count: int = Field(5, ge=1)
    buffer_size: int = Field(100_000_000, ge=1)
    max_in_cpu: int = Field(1_000_000_000, ge=0)


class OffloadOptimizerConfig(_OffloadBase):
    buffer_count: int = Field(4, ge=1)
    pipeline_read: bool = False
    pipeline_write: bool = False
    fast_init: bool = False
    ratio: float = Field(1.0, ge=0.0, le=1.0)

    @field_validator("ratio")
    @classmethod
    def _whole_offload(cls, value: float) -> float:
        if value != 1.0:
            raise ValueError("partial offload (ratio < 1) is not supported; use 1.0 or remove the key")
        return value


class ZeroConfig(Section):
    stage: int = Field(0, ge=0, le=3)
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    reduce_bucket_size: Union[int, Auto] = Field(500_000_000)
    use_multi_rank_bucket_allreduce: bool = True
    allgather_partitions: bool = True
    allgather_bucket_size: Union[int, Auto] = Field(500_000_000)
    overlap_comm: Optional[bool] = None
    load_from_fp32_weights: bool = True
    elastic_checkpoint: bool = False
    offload_param: Optional[OffloadParamConfig] = None
    offload_optimizer: Optional[OffloadOptimizerConfig] = None
    sub_group_size: int = Field(1_000_000_000, ge=1)
    prefetch_bucket_size: Union[int, Auto] = Field(50_000_000, alias="stage3_prefetch_bucket_size")
    param_persistence_threshold: Union[int, Auto] = Field(100_000, alias="stage3_param_persistence_threshold")
    model_persistence_threshold: int = Field(2**63 - 1, ge=0, alias="stage3_model_persistence_threshold")
    max_live_parameters: int = Field(1_000_000_000, ge=0, alias="stage3_max_live_parameters")
    max_reuse_distance: int = Field(1_000_000_000, ge=0, alias="stage3_max_reuse_distance")
    gather_16bit_weights_on_model_save: bool = Field(False, alias="stage3_gather_16bit_weights_on_model_save")
    module_granularity_threshold: int = Field(0, ge=0, alias="stage3_module_granularity_threshold")
    use_all_reduce_for_fetch_params: bool = Field(False, alias="stage3_use_all_reduce_for_fetch_params")
    allgather_sequential: bool = Field(False, alias="stage3_allgather_sequential")
    ignore_unused_parameters: bool = True
    legacy_stage1: bool = False
    round_robin_gradients: bool = False
    zero_hpz_partition_size: int = Field(1, ge=1)
    zero_quantized_weights: bool = False
    zero_quantized_nontrainable_weights: bool = False
    zero_quantized_gradients: bool = False
    zeropp_loco_param: Optional[dict[str, Any]] = None
    mics_shard_size: int = Field(-1, ge=-1)
    mics_hierarchical_params_gather: bool = False
    memory_efficient_linear: bool = True
    pipeline_loading_checkpoint: bool = False
    override_module_apply: bool = True
    log_trace_cache_warnings: bool = False
    enable_sanity_checks: bool = False
    gather_unit_classes: list[str] = Field(default_factory=list)
    gather_unit_min_params: int = Field(1_000_000, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _deprecated_keys(cls, values: Any) -> Any:
        values = _rename_deprecated(
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
        "reduce_bucket_size", "allgather_bucket_size", "prefetch_bucket_size", "param_persistence_threshold"
    )
    @classmethod
    def _non_negative(cls, value):
        if value != "auto" and value < 0:
            raise ValueError("must be >= 0")
        return value

    @model_validator(mode="after")
    def _offload_param_needs_stage3(self):
        if self.offload_param is not None and self.offload_param.device is not OffloadDevice.none and self.stage != 3:
            raise ValueError(
                f"offload_param works only with stage 3 (stage is {self.stage}); "
                "use offload_optimizer for stages 1 and 2"
            )
        if self.offload_optimizer is not None and self.offload_optimizer.device is not OffloadDevice.none:
            if self.stage == 0:
                raise ValueError("offload_optimizer needs a sharded optimizer: set stage to 1, 2 or 3")
        if self.zero_hpz_partition_size > 1 and self.mics_shard_size > 0:
            raise ValueError("set either zero_hpz_partition_size or mics_shard_size, not both")
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
    legacy_fusion: bool = False


class SchedulerConfig(Section):
    type: str
    params: dict[str, Any] = Field(default_factory=dict)


class CommsLoggerConfig(Section):
    enabled: bool = False
    verbose: bool = False
    prof_all: bool = True
    debug: bool = False
    prof_ops: list[str] = Field(default_factory=list)


class ActivationCheckpointingConfig(Section):
    partition_activations: bool = False
    contiguous_memory_optimization: bool = False
    cpu_checkpointing: bool = False
    number_checkpoints: Optional[int] = Field(None, ge=1)
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


class AioConfig(Section):
    block_size: int = Field(1_048_576, gt=0)
    queue_depth: int = Field(8, gt=0)
    intra_op_parallelism: int = Field(1, ge=1)
    single_submit: bool = False
    overlap_events: bool = True
    use_gds: bool = False

    @field_validator("use_gds")
    @classmethod
    def _no_gds(cls, value: bool) -> bool:
        if value:
            raise ValueError("GPUDirect Storage is not supported; set it to false")
        return value

    @model_validator(mode="before")
    @classmethod
    def _thread_count(cls, values: Any) -> Any:
        return _rename_deprecated(values, "thread_count", "intra_op_parallelism")


class CheckpointConfig(Section):
    tag_validation: Literal["Ignore", "Warn", "Fail", "ignore", "warn", "fail", "IGNORE", "WARN", "FAIL"] = "Warn"
    load_universal: bool = False
    use_node_local_storage: bool = False
    parallel_write: dict[str, Any] = Field(default_factory=dict)


class MonitorConfig(Section):
    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


class WandbConfig(Section):
    enabled: bool = False
    group: Optional[str] = None
    team: Optional[str] = None
    project: str = "deepspeed"


class CometConfig(Section):
    enabled: bool = False
    samples_log_interval: int = 100
    project: Optional[str] = None
    workspace: Optional[str] = None
    api_key: Optional[str] = None
    experiment_name: Optional[str] = None
    experiment_key: Optional[str] = None
    online: Optional[bool] = None
    mode: Optional[str] = None


class DataTypesConfig(Section):
    grad_accum_dtype: Optional[DTypeName] = None


# DeepSpeed feature blocks we parse but do not implement: accepted when absent or disabled.
UNSUPPORTED_FEATURE_BLOCKS = (
    "flops_profiler",
    "elasticity",
    "autotuning",
    "compression_training",
    "data_efficiency",
    "curriculum_learning",
    "sparse_attention",
    "pipeline",
    "amp",
    "progressive_layer_drop",
    "eigenvalue",
    "quantize_training",
    "hybrid_engine",
    "compile",
    "tensor_parallel",
    "nebula",
    "weight_quantization",
)


class ZeroshardConfig(Section):
    train_batch_size: Union[int, Auto, None] = Field(None)
    train_micro_batch_size_per_gpu: Union[int, Auto, None] = Field(None)
    gradient_accumulation_steps: Union[int, Auto, None] = Field(None)
    steps_per_print: Optional[int] = Field(10, ge=1)
    gradient_clipping: Union[float, Auto] = 0.0
    # zeroshard's own: stop after this many optimizer steps in a row were skipped for non-finite gradients
    # without a dynamic fp16 loss scale to recover them (fp32/bf16, or a static fp16 scale); 0 never stops
    max_consecutive_skipped_steps: int = Field(20, ge=0)
    prescale_gradients: bool = False
    gradient_predivide_factor: float = Field(1.0, gt=0)
    communication_data_type: Optional[DTypeName] = None
    fp16: FP16Config = Field(default_factory=FP16Config)
    bf16: BF16Config = Field(default_factory=BF16Config, alias="bfloat16")
    optimizer: Optional[OptimizerConfig] = None
    scheduler: Optional[SchedulerConfig] = None
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    zero_allow_untested_optimizer: bool = False
    zero_force_ds_cpu_optimizer: bool = True
    wall_clock_breakdown: bool = False
    memory_breakdown: bool = False
    dump_state: bool = False
    sparse_gradients: bool = False
    disable_allgather: bool = False
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
    flops_profiler: Optional[dict[str, Any]] = None
    elasticity: Optional[dict[str, Any]] = None
    autotuning: Optional[dict[str, Any]] = None
    compression_training: Optional[dict[str, Any]] = None
    data_efficiency: Optional[dict[str, Any]] = None
    curriculum_learning: Optional[dict[str, Any]] = None
    sparse_attention: Optional[dict[str, Any]] = None
    pipeline: Optional[dict[str, Any]] = None
    amp: Optional[dict[str, Any]] = None
    progressive_layer_drop: Optional[dict[str, Any]] = None
    eigenvalue: Optional[dict[str, Any]] = None
    quantize_training: Optional[dict[str, Any]] = None
    hybrid_engine: Optional[dict[str, Any]] = None
    compile: Optional[dict[str, Any]] = None
    tensor_parallel: Optional[dict[str, Any]] = None
    nebula: Optional[dict[str, Any]] = None
    weight_quantization: Optional[dict[str, Any]] = None

    @field_validator("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    @classmethod
    def _positive(cls, value):
        if isinstance(value, int) and value < 1:
            raise ValueError("must be a positive integer")
        return value

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
