"""The parallelism blocks besides ZeRO: ``pipeline``, ``tensor_parallel`` (AutoTP) and ``expert_parallel`` (AutoEP),
with DeepSpeed 0.19's keys."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, field_validator, model_validator

from .patterns import check_pattern
from .section import DTypeName, Section, refused, satisfied


class PipelineConfig(Section):
    """DeepSpeed's ``pipeline`` block, read when the model is a ``PipelineModule`` (the module's own arguments decide
    its stages and partition, as in DeepSpeed). ``stages`` must match the module's; ``activation_checkpoint_interval``
    > 0 sets the module's; ``use_reentrant: false`` makes its checkpoint function torch's non-reentrant one (the
    default of zeroshard's ``PipelineModule`` already). With tensor parallelism inside the stages,
    ``pipe_partitioned`` / ``grad_partitioned`` send each tensor-parallel rank's slice of the activations / input
    gradients between stages, gathered over the receiving stage's tensor group (``zeroshard.pipe.exchange``): 1/T of
    the bytes between stages, the same values; off, each rank sends them whole. No effect without tensor
    parallelism. ``schedule`` (zeroshard's) orders each stage's work: ``"1f1b"`` (DeepSpeed's ``TrainSchedule``) or
    ``"zb-h1"`` (zero bubble: each backward split, the weight gradients run where a stage would idle)."""

    stages: Optional[int] = None  # "auto" (DeepSpeed's default): the module's
    partition: str = "best"
    seed_layers: bool = False
    activation_checkpoint_interval: int = Field(0, ge=0)
    pipe_partitioned: bool = True
    grad_partitioned: bool = True
    use_reentrant: Optional[bool] = None
    # zeroshard's: the most the activations one micro-batch sends to the next stage may take (None: a quarter of the
    # device's memory); a receiving stage refuses an announcement above it before allocating anything
    max_activation_bytes: Optional[int] = Field(None, ge=1)
    # zeroshard's: the training schedule, DeepSpeed's 1F1B or zero-bubble ZB-H1 (zeroshard.pipe.zero_bubble)
    schedule: Literal["1f1b", "zb-h1"] = "1f1b"

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
