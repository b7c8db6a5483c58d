"""Typed schema of the DeepSpeed-compatible JSON config: the top level and its smaller blocks. The larger blocks live
by concept: ``zero_optimization`` (ZeRO and offload), ``parallelism`` (pipeline, tensor and expert parallelism),
``monitoring`` (what a run reports).

Field names and aliases follow DeepSpeed 0.19 so that an existing ``ds_config.json`` parses
unchanged. Values that may be ``"auto"`` stay ``"auto"`` here; :mod:`.resolve` replaces them.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Literal, Optional, Union

from pydantic import Field, field_validator, model_validator

from .monitoring import CometConfig, CommsLoggerConfig, FlopsProfilerConfig, MonitorConfig, WandbConfig
from .parallelism import ExpertParallelConfig, PipelineConfig, TensorParallelTrainingConfig
from .section import Auto, DTypeName, Section, refused, rename_deprecated, satisfied, warned
from .zero_optimization import OffloadDevice, ZeroConfig


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


class OptimizerConfig(Section):
    type: str
    params: dict[str, Any] = Field(default_factory=dict)
    legacy_fusion: bool = refused(False, "not implemented")


class SchedulerConfig(Section):
    type: str
    params: dict[str, Any] = Field(default_factory=dict)


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


_ZERO_PASSES = {"z1": (1, 2), "z3": (3,)}  # DeepCompile's ZeRO passes, and the stages each serves


class CompileConfig(Section):
    """DeepSpeed's ``compile`` block. The engine compiles only when ``engine.compile()`` is called (as DeepSpeed):
    ``backend`` and ``kwargs`` are what that call uses when it names none, and ``disable: true`` makes it a no-op.

    ``deepcompile: true`` (OpenRLHF's ``--ds.deepcompile``, axolotl's ``deepcompile:``) is served by what
    ``engine.compile()`` always does: each gather unit compiled with its gathers, prefetches and reductions outside
    (DeepCompile inserts them into one graph instead). Its ZeRO ``passes`` must name the configured stage; its tuning
    knobs are accepted and, when not their default, named in one warning saying why they change nothing."""

    disable: bool = False
    backend: str = "inductor"
    kwargs: dict[str, Any] = Field(default_factory=dict)
    deepcompile: bool = False
    autoep_non_moe: bool = refused(
        False, "compiling the parents of AutoEP layers apart is not implemented; engine.compile() compiles the module"
    )
    free_activation: bool = warned(
        False, "inductor frees each intermediate at its last use inside a compiled unit; to keep fewer activations "
        "for backward, use activation checkpointing"
    )  # fmt: skip
    free_activation_threshold: int = warned(10 * 1024 * 1024, "see free_activation")
    offload_activation: bool = warned(
        False, "saved activations stay on the device; activation_checkpointing.cpu_checkpointing moves the "
        "checkpointed inputs to the host"
    )  # fmt: skip
    offload_activation_pin_memory: bool = warned(True, "see offload_activation")
    offload_opt_states: bool = warned(
        False, "optimizer states stay where zero_optimization.offload_optimizer puts them (engine.offload_states() "
        "moves them between steps)"
    )  # fmt: skip
    offload_parameters: bool = warned(False, "parameters stay where zero_optimization.offload_param puts them")
    double_buffer: bool = warned(
        True, "zeroshard's prefetch gathers the next unit during this one (stage3_prefetch_bucket_size; 0 turns "
        "it off)"
    )  # fmt: skip
    symmetric_memory: bool = warned(False, "collectives use the process group's own buffers")
    debug_log: bool = warned(False, "there are no graph passes to log; engine.compile() logs the regions and breaks")
    sync_before_reduce: bool = warned(False, "zeroshard waits on a reduction where its result is read")
    sync_after_reduce: bool = warned(False, "see sync_before_reduce")
    sync_before_allgather: bool = warned(False, "zeroshard waits on a gather where its result is read")
    sync_after_allgather: bool = warned(False, "see sync_before_allgather")
    keep_int_input_tensors: bool = warned(True, "zeroshard profiles no graph on stored inputs")
    keep_all_input_tensors: bool = warned(False, "see keep_int_input_tensors")
    passes: Optional[list[Literal["z1", "z3", "autosp", "autotp"]]] = None

    @field_validator("passes")
    @classmethod
    def _served_passes(cls, value: Optional[list[str]]) -> Optional[list[str]]:
        for name, instead in (("autosp", "sequence_parallel_size"), ("autotp", "tensor_parallel.autotp_size")):
            if value and name in value:
                raise NotImplementedError(
                    f"compile.passes {value}: DeepCompile's '{name}' pass (parallelizing a model while compiling "
                    f"it) is not implemented; set {instead} instead, and engine.compile() compiles the parallel model"
                )
        return value

    def check_stage(self, stage: int) -> None:
        """Refuse ZeRO passes for another stage than ``stage`` (``passes: ["z3"]`` with ZeRO-1): a ``ValueError``."""
        wrong = [p for p in self.passes or () if p in _ZERO_PASSES and stage not in _ZERO_PASSES[p]]
        if wrong:
            serves = {p: _ZERO_PASSES[p] for p in wrong}
            raise ValueError(
                f"compile.passes {wrong} serve ZeRO stages {serves}, but zero_optimization.stage is {stage}; name the "
                "configured stage's pass (z1 for stages 1-2, z3 for stage 3) or leave passes unset"
            )


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
    def _compile_passes(self):
        self.compile.check_stage(self.zero_optimization.stage)
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
