"""Activation checkpointing under DeepSpeed's names (``deepspeed.checkpointing`` in compatibility mode):
recompute a segment's activations in backward instead of keeping them.

Recomputation is non-reentrant (``torch.utils.checkpoint`` with ``use_reentrant=False``): it composes with ZeRO's
gradient hooks and stage-3 gathers (a recomputed unit is gathered again), and works when no input requires a
gradient. What ``configure`` (or the config's ``activation_checkpointing`` block) sets:

- ``checkpoint_in_cpu`` / ``cpu_checkpointing``: the tensors a checkpoint keeps -- its inputs, the only
  activations left at a segment boundary -- wait for backward in host memory (pinned when the device is a GPU)
  and are copied back for the recomputation. On a CPU-only machine host memory is where they already are.
- ``synchronize`` / ``synchronize_checkpoint_boundary``: the device is synchronized before and after each
  checkpointed forward and recomputation.
- ``profile``: each checkpointed forward and recomputation logs its time (rank 0).
- ``partition_activations``: DeepSpeed splits checkpoint inputs across model-parallel ranks; zeroshard trains
  without model parallelism (every ``mpu_`` must report one model-parallel rank), where that split has one part
  -- which is also what DeepSpeed does then.
- ``num_checkpoints`` / ``number_checkpoints``: sizes DeepSpeed's contiguous buffers; recorded, used by nothing
  else (as in DeepSpeed without ``contiguous_checkpointing``).
- ``contiguous_checkpointing`` / ``contiguous_memory_optimization``: satisfied. DeepSpeed copies checkpoint inputs
  into preallocated buffers against fragmentation; here they stay in the blocks torch's caching allocator gave them,
  which it reuses step after step (DeepSpeed's own ``TestPipeModuleSequential`` sets both).

DeepSpeed's API is module-level (``configure`` once, then ``checkpoint`` anywhere in the model); what ``configure``
sets lives in this module (``reset()`` returns it to the defaults). A config's block belongs to its engine: the
engine puts its options in effect (a context variable) while its forward runs, so two engines with different
blocks in one process keep their own, and ``initialize`` writes nothing process-wide.
"""

from __future__ import annotations

import contextlib
import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.utils.checkpoint

from ..accelerator import copy_across, get_accelerator, moved_across
from ..log import log_rank0


@dataclass(frozen=True)
class CheckpointingOptions:
    cpu_checkpointing: bool = False
    synchronize: bool = False
    profile: bool = False
    partition_activations: bool = False
    number_checkpoints: Optional[int] = None

    @property
    def wraps_segments(self) -> bool:
        """Whether each checkpointed segment does eager work around it (host copies, synchronizations, timings),
        which compiled code skips."""
        return self.cpu_checkpointing or self.synchronize or self.profile


_configured: Optional[CheckpointingOptions] = None  # what configure() set; None until it ran (is_configured)
# the options of the engine whose forward is running (its config's activation_checkpointing block), if any
_engine_options: ContextVar[Optional[CheckpointingOptions]] = ContextVar("engine_checkpointing", default=None)


def options_from(deepspeed_config: Any = None, mpu_: Any = None, **given: Any) -> CheckpointingOptions:
    """The options a config's ``activation_checkpointing`` block (a path, a dict, a parsed config or the block)
    sets, with ``configure``'s keyword arguments that are not None (``given``) overriding it, as in DeepSpeed;
    refuses what zeroshard lacks (``contiguous_checkpointing`` is satisfied: see the module's docstring)."""
    block = _config_block(deepspeed_config)
    overrides = {k: v for k, v in given.items() if v is not None}
    if mpu_ is not None and _model_parallel_size(mpu_) != 1:
        raise NotImplementedError(
            f"mpu_ reports {_model_parallel_size(mpu_)} model-parallel ranks; zeroshard trains without model "
            "parallelism, so activations cannot be partitioned across model-parallel ranks"
        )
    options = CheckpointingOptions(
        cpu_checkpointing=bool(overrides.get("checkpoint_in_cpu", block.cpu_checkpointing)),
        synchronize=bool(overrides.get("synchronize", block.synchronize_checkpoint_boundary)),
        profile=bool(overrides.get("profile", block.profile)),
        partition_activations=bool(overrides.get("partition_activations", block.partition_activations)),
        number_checkpoints=overrides.get("num_checkpoints", block.number_checkpoints),
    )
    if options.partition_activations:
        log_rank0("activation checkpointing: partition_activations with one model-parallel rank keeps inputs whole")
    return options


def configure(
    mpu_: Any = None,
    deepspeed_config: Any = None,
    partition_activations: Optional[bool] = None,
    contiguous_checkpointing: Optional[bool] = None,
    num_checkpoints: Optional[int] = None,
    checkpoint_in_cpu: Optional[bool] = None,
    synchronize: Optional[bool] = None,
    profile: Optional[bool] = None,
) -> None:
    """DeepSpeed's module-level API: set the options ``checkpoint`` uses outside an engine's forward (and inside the
    forward of an engine whose config has no ``activation_checkpointing`` block)."""
    global _configured
    _configured = options_from(
        deepspeed_config,
        mpu_,
        partition_activations=partition_activations,
        contiguous_checkpointing=contiguous_checkpointing,
        num_checkpoints=num_checkpoints,
        checkpoint_in_cpu=checkpoint_in_cpu,
        synchronize=synchronize,
        profile=profile,
    )


@contextlib.contextmanager
def in_effect(options: Optional[CheckpointingOptions]) -> Iterator[None]:
    """While open (an engine's forward), ``checkpoint`` uses ``options``; None leaves what ``configure`` set."""
    if options is None:
        yield
        return
    token = _engine_options.set(options)
    try:
        yield
    finally:
        _engine_options.reset(token)


def _config_block(deepspeed_config: Any):
    from ..config import parse_config
    from ..config.schema import ActivationCheckpointingConfig

    if deepspeed_config is None:
        return ActivationCheckpointingConfig()
    if isinstance(deepspeed_config, ActivationCheckpointingConfig):
        return deepspeed_config
    block = getattr(deepspeed_config, "activation_checkpointing", None)
    if isinstance(block, ActivationCheckpointingConfig):
        return block
    return parse_config(deepspeed_config).activation_checkpointing


def _model_parallel_size(mpu: Any) -> int:
    for name in ("get_model_parallel_world_size", "get_tensor_model_parallel_world_size"):
        if hasattr(mpu, name):
            return int(getattr(mpu, name)())
    raise TypeError(f"mpu_ of type {type(mpu).__name__} has no get_model_parallel_world_size()")


def is_configured() -> bool:
    """Whether options are in effect here: ``configure`` ran (and no ``reset`` since), or an engine whose config
    has an ``activation_checkpointing`` block is running its forward."""
    return _configured is not None or _engine_options.get() is not None


def reset() -> None:
    """Back to the defaults. (DeepSpeed also frees its contiguous buffers here; zeroshard keeps none.)"""
    global _configured
    _configured = None


def checkpoint(function, *args) -> Any:
    """Run ``function(*args)`` keeping only its inputs; its activations are recomputed in backward. Inside a compiled
    region (``engine.compile()``) plainly, as torch's: the options' host copies, synchronizations and timings are
    eager work (and dynamo cannot read the context variable that holds them)."""
    if torch.compiler.is_compiling():
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)
    options = _engine_options.get() or _configured or CheckpointingOptions()
    if not options.wraps_segments:
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)
    device = next((a.device for a in args if torch.is_tensor(a)), None)
    if options.cpu_checkpointing and device is not None and device.type != "cpu":
        pin = get_accelerator().can_pin_memory
        args = tuple(_to_host(a, pin) for a in args)
        return torch.utils.checkpoint.checkpoint(_Segment(function, options, device), *args, use_reentrant=False)
    return torch.utils.checkpoint.checkpoint(_Segment(function, options, None), *args, use_reentrant=False)


non_reentrant_checkpoint = checkpoint  # DeepSpeed's name for the same call


def _to_host(value: Any, pin: bool) -> Any:
    """A host copy of a device tensor; ``copy_`` is differentiable, so gradients still reach the device tensor
    (whose memory is not kept: the copy's backward needs only the device to send the gradient to)."""
    if not torch.is_tensor(value):
        return value
    host = torch.empty(value.shape, dtype=value.dtype, pin_memory=pin)
    return copy_across(host, value, to_host=True, non_blocking=pin)


class _Segment:
    """The checkpointed function with the options around it: inputs back to the device, synchronization,
    timing. Called once in forward and once more when backward recomputes."""

    def __init__(self, function, options: CheckpointingOptions, device: Optional[torch.device]):
        self.function = function
        self.options = options
        self.device = device

    def __call__(self, *args):
        if self.device is not None:
            args = tuple(
                moved_across(a, self.device, to_host=False, non_blocking=True) if torch.is_tensor(a) else a
                for a in args
            )
        accel = get_accelerator()
        if self.options.synchronize:
            accel.synchronize()
        started = time.perf_counter()
        try:
            return self.function(*args)
        finally:
            # also when torch stops a recomputation early (it raises inside the function once backward has
            # every tensor it needs): the time spent recomputing is still logged
            if self.options.synchronize or self.options.profile:
                accel.synchronize()
            if self.options.profile:
                phase = "recompute" if torch._C._current_graph_task_id() != -1 else "forward"
                name = getattr(self.function, "__qualname__", type(self.function).__name__)
                log_rank0(f"activation checkpoint {name}: {phase} {1e3 * (time.perf_counter() - started):.2f} ms")
