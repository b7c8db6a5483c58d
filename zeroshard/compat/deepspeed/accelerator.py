"""``deepspeed.accelerator``: DeepSpeed's accelerator interface (``abstract_accelerator.py``) over zeroshard's.

zeroshard's ``Accelerator`` answers the device calls (RNG, streams, memory, graph capture, pinning); this adapter adds
the names only DeepSpeed has: its typed-tensor constructors, op builders, launcher environment, compile backend and
the older memory aliases. DeepSpeed's tutorial tells model code to write ``get_accelerator().<x>(...)`` for most
``torch.cuda.<x>`` calls, so every public name of DeepSpeed's interface is here (``tests/unit/compat``) and does what
DeepSpeed's accelerator for that device does, except where DeepSpeed's CPU answer would be silently wrong
(``docs/deepspeed-compat.md``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

from zeroshard import accelerator as _device
from zeroshard.accelerator import Accelerator, GraphCaptureUnavailable

from ._not_built import not_built
from .ops import op_builder

_NO_EXTENSIONS = "zeroshard builds no C++/CUDA extensions: its optimizers are torch's kernels, its NVMe I/O its own"
_TYPED_TENSORS = {
    "BFloat16Tensor": torch.bfloat16,
    "ByteTensor": torch.uint8,
    "DoubleTensor": torch.double,
    "FloatTensor": torch.float,
    "HalfTensor": torch.half,
    "IntTensor": torch.int,
    "LongTensor": torch.long,
}


@dataclass(frozen=True)
class DeepSpeedAccelerator(Accelerator):
    """One per process and device kind (``get_accelerator``), as DeepSpeed's: ``set_compile_backend`` is remembered."""

    # the one setting DeepSpeed's clients change on the accelerator (compare=False: not part of the device's identity)
    settings: dict = field(default_factory=lambda: {"compile_backend": "inductor"}, compare=False, repr=False)

    # -- what kind of device ---------------------------------------------------------------------------------
    @property
    def _name(self) -> str:  # clients read DeepSpeed's private attribute (``get_accelerator()._name == "cpu"``)
        return self.name

    @property
    def _communication_backend_name(self) -> str:
        return self.comm_backend

    @property
    def supports_nvtx_domain(self) -> bool:
        return self.name == "cuda"

    def is_synchronized_device(self) -> bool:
        """A CPU runs work in order as issued; a GPU queues it."""
        return self.name == "cpu"

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        return self.is_synchronized_device()

    def is_fp64_supported(self) -> bool:
        return True

    def is_triton_supported(self) -> bool:
        return self.name == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8

    def prefer_triton_grouped_mm(self) -> bool:
        return False  # zeroshard has no Triton expert kernels

    def lazy_call(self, callback):
        """Run ``callback`` once the device is initialized (at once on CPU)."""
        return torch.cuda._lazy_call(callback) if self.name == "cuda" else callback()

    # -- DeepSpeed's older memory names (torch's deprecated aliases) ----------------------------------------------
    def memory_cached(self, device_index: Optional[int] = None) -> int:
        return self.memory_reserved(device_index)

    def max_memory_cached(self, device_index: Optional[int] = None) -> int:
        return self.max_memory_reserved(device_index)

    def reset_max_memory_allocated(self, device_index: Optional[int] = None) -> None:
        self.reset_peak_memory_stats(device_index)

    def reset_max_memory_cached(self, device_index: Optional[int] = None) -> None:
        self.reset_peak_memory_stats(device_index)

    # -- typed tensors: torch's legacy classes on CPU, constructors on the device on CUDA (DeepSpeed's choice) --
    def _typed_tensor(self, name: str):
        if self.name == "cpu":
            return getattr(torch, name)
        return functools.partial(torch.tensor, dtype=_TYPED_TENSORS[name], device=self.name)

    BFloat16Tensor = property(lambda self: self._typed_tensor("BFloat16Tensor"))
    ByteTensor = property(lambda self: self._typed_tensor("ByteTensor"))
    DoubleTensor = property(lambda self: self._typed_tensor("DoubleTensor"))
    FloatTensor = property(lambda self: self._typed_tensor("FloatTensor"))
    HalfTensor = property(lambda self: self._typed_tensor("HalfTensor"))
    IntTensor = property(lambda self: self._typed_tensor("IntTensor"))
    LongTensor = property(lambda self: self._typed_tensor("LongTensor"))

    # -- host memory -----------------------------------------------------------------------------------------
    def pin_empty(self, *size: Any, dtype: torch.dtype, device: Any = "cpu") -> torch.Tensor:
        """A fresh host buffer of ``size`` (page-locked where there is a device to copy to)."""
        _host_only(device, "pin_empty")
        shape = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
        return torch.empty(shape, dtype=dtype, pin_memory=self.can_pin_memory)

    def pin_empty_like(self, tensor: torch.Tensor, device: Any = "cpu", dtype: Optional[torch.dtype] = None):
        _host_only(device, "pin_empty_like")
        return self.pin_empty(tuple(tensor.shape), dtype=dtype or tensor.dtype)

    def unpin_memory(self, tensor: torch.Tensor) -> None:
        """Nothing: torch frees a pinned tensor's pages with the tensor."""
        return None

    def register_host_memory(self, address: int, num_bytes: int) -> bool:
        """Page-lock host memory zeroshard did not allocate (``cudaHostRegister``); a CPU has nothing to register."""
        if self.name != "cuda":
            return False
        torch.cuda.check_error(int(torch.cuda.cudart().cudaHostRegister(address, num_bytes, 0)))
        return True

    def unregister_host_memory(self, address: int) -> None:
        if self.name == "cuda":
            torch.cuda.check_error(int(torch.cuda.cudart().cudaHostUnregister(address)))

    def pin_memory_alignment(self) -> int:
        return 1

    # -- op builders: zeroshard builds no extensions -----------------------------------------------------------
    def op_builder_dir(self) -> str:
        return "deepspeed.ops.op_builder"

    def get_op_builder(self, class_name: Union[str, type]) -> type:
        """DeepSpeed's builder class of that name: its placeholder, whose construction says zeroshard builds no
        extensions and what to use instead."""
        name = class_name if isinstance(class_name, str) else class_name.__name__
        known = getattr(op_builder, name, None)
        if known is not None:
            return known
        return not_built(f"deepspeed.ops.op_builder.{name}", _NO_EXTENSIONS)

    def create_op_builder(self, class_name: Union[str, type]) -> Any:
        return self.get_op_builder(class_name)()

    def build_extension(self) -> type:
        from torch.utils.cpp_extension import BuildExtension

        return BuildExtension

    # -- launcher environment ----------------------------------------------------------------------------------
    def export_envs(self) -> list[str]:
        """Prefixes of the variables a multi-node launch passes on to every node."""
        return ["NCCL"] if self.name == "cuda" else []

    def visible_devices_envs(self) -> list[str]:
        return ["CUDA_VISIBLE_DEVICES"]

    def set_visible_devices_envs(self, current_env: dict, local_accelerator_ids: list) -> None:
        for name in self.visible_devices_envs():
            current_env[name] = ",".join(map(str, local_accelerator_ids))

    # -- compile backend -----------------------------------------------------------------------------------------
    @property
    def _compile_backend(self) -> str:
        return self.settings["compile_backend"]

    def get_compile_backend(self) -> str:
        return self.settings["compile_backend"]

    def set_compile_backend(self, backend: str) -> None:
        supported = torch._dynamo.list_backends(exclude_tags=())
        if backend not in supported:
            raise ValueError(f"{backend} not supported by {self.device_name()}. Supported Backends are {supported}")
        self.settings["compile_backend"] = backend


def _host_only(device: Any, call: str) -> None:
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"get_accelerator().{call}(device={device!r}): host memory lives on 'cpu'") from err
    if kind != "cpu":
        raise ValueError(f"get_accelerator().{call}(device={device!r}): host memory lives on 'cpu'")


@functools.cache
def _accelerator_of(name: str, comm_backend: str) -> DeepSpeedAccelerator:
    return DeepSpeedAccelerator(name, comm_backend)


def get_accelerator() -> DeepSpeedAccelerator:
    """This process's accelerator: the same object at every call for a device kind, as DeepSpeed's (a backend set
    by ``set_compile_backend`` stays set); the kind is zeroshard's choice (``ZEROSHARD_ACCELERATOR``, else CUDA
    when visible)."""
    device = _device.get_accelerator()
    return _accelerator_of(device.name, device.comm_backend)


def is_current_accelerator_supported() -> bool:
    """DeepSpeed asks whether its kernels exist for this device kind; zeroshard runs the same code on CPU and GPU."""
    return get_accelerator().device().type in ("cpu", "cuda")


__all__ = [
    "Accelerator",
    "DeepSpeedAccelerator",
    "GraphCaptureUnavailable",
    "get_accelerator",
    "is_current_accelerator_supported",
]
