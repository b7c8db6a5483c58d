"""The ``zero_optimization`` block: the stage and its knobs, the ``offload_param`` / ``offload_optimizer`` sub-blocks
and leaf modules, with DeepSpeed 0.19's keys and aliases."""

from __future__ import annotations

import warnings
from enum import Enum
from pathlib import Path
from typing import Any, Optional, Union

from pydantic import Field, field_validator, model_validator

from .section import Auto, Section, refused, rename_deprecated, satisfied


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
