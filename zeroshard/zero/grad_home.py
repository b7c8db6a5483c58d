"""Where one flat group's reduced gradient shard waits between backward and the optimizer step.

- :class:`ResidentGrad`: an fp32 (or compute-dtype) tensor on the compute device, or in host memory when the
  optimizer state is offloaded to the CPU, where the optimizer state steps it.
- :class:`SpilledGrad` (``offload_optimizer.device: nvme``, for a flat group whose parameter shard is on NVMe too):
  in the optimizer's swap file, one region per sub-group
  beside its master weights and moments. Each reduction's result is accumulated in a transient buffer drawn from the
  engine's reusable buffers, written behind (:meth:`NvmeOptimizerSwapper.write_grad`) and the buffer given back, so
  host memory holds one bucket's gradient at a time, never the model's; the step reads each sub-group's gradient
  together with its state.

The gradient waits until the step's verdict (the clip coefficient and the fp16 overflow, known only after the last
gradient) even when the step runs during backward (:mod:`.speculation`): a speculated step reads it as it becomes
final, and a step the verdict replays reads it again, from the same place. The cost is 4 bytes per parameter written
during backward (overlapped with it) and read in the step, beside the 24 the step moves anyway
(``docs/tutorials/offload.md``).

Both homes do the same arithmetic in the same order (``zero_``, ``add_(reduced, alpha)``, then the step's
``mul_(coef)`` on a range), so a spilled gradient yields the same bits as a resident one; the squared norm is taken
of the same values, once, when the last contribution of a step arrived.
"""

from __future__ import annotations

import time
from typing import Optional, Protocol

import torch

from ..accelerator import crossed, moved_across
from ..offload import NvmeOptimizerSwapper, SubGroup
from .buffers import ReusableBuffers


def shard_norm(values: torch.Tensor) -> torch.Tensor:
    """The 2-norm of one gradient shard in fp32 (a 0-d tensor), computed one way for every home."""
    return torch._foreach_norm([values], 2, dtype=torch.float32)[0]


class GradHome(Protocol):
    numel: int
    dtype: torch.dtype

    def accumulate(self, reduced: torch.Tensor, alpha: float, final: bool) -> None: ...  # += alpha * reduced

    def norm(self) -> torch.Tensor: ...  # of the accumulated gradient, fp32, 0-d

    def read(self) -> torch.Tensor: ...  # the whole shard (the tensor itself where it is resident)

    def write(self, start: int, values: torch.Tensor) -> None: ...  # overwrite part of it

    def clear(self) -> None: ...

    def resident(self) -> Optional[torch.Tensor]: ...  # the tensor itself, or None where it is not in memory

    def bytes(self) -> dict[str, int]: ...  # by location


class ResidentGrad:
    """The gradient shard as one tensor (zeros, or one an exchange transformed); ``location`` names where it lives
    for the byte counts."""

    def __init__(self, tensor: torch.Tensor, location: str, pin: bool = False):
        self.tensor, self.location, self.pin = tensor, location, pin
        self.dtype, self.device = tensor.dtype, tensor.device

    @classmethod
    def zeros(cls, numel: int, dtype: torch.dtype, device: torch.device, pin: bool, location: str) -> "ResidentGrad":
        return cls(torch.zeros(numel, dtype=dtype, device=device, pin_memory=pin), location, pin)

    @property
    def numel(self) -> int:
        return self.tensor.numel()

    def resize(self, numel: int) -> None:
        """Hold ``numel`` elements (a 1-bit optimizer's own whole gradient); only between steps, when empty."""
        if numel != self.tensor.numel():
            self.tensor = torch.zeros(numel, dtype=self.dtype, device=self.device, pin_memory=self.pin)

    def accumulate(self, reduced: torch.Tensor, alpha: float, final: bool) -> None:
        if self.location == "host":  # the reduced gradient crosses to the host optimizer
            reduced = moved_across(reduced, self.tensor.device, to_host=True)
        else:
            reduced = reduced.to(self.tensor.device)
        self.tensor.add_(reduced, alpha=alpha)

    def norm(self) -> torch.Tensor:
        return shard_norm(self.tensor)

    def read(self) -> torch.Tensor:
        return self.tensor

    def write(self, start: int, values: torch.Tensor) -> None:
        self.tensor[start : start + values.numel()].copy_(values)

    def clear(self) -> None:
        self.tensor.zero_()

    def resident(self) -> Optional[torch.Tensor]:
        return self.tensor

    def bytes(self) -> dict[str, int]:
        return {self.location: self.tensor.numel() * self.tensor.element_size()}


class SpilledGrad:
    """The gradient shard of one flat group in the optimizer swap file, cut like its optimizer sub-groups."""

    def __init__(
        self,
        subs: list[SubGroup],
        swapper: NvmeOptimizerSwapper,
        buffers: ReusableBuffers,
        dtype: torch.dtype,
    ):
        # ``dtype``: what the resident shard would be (accumulated in it, bit for bit; kept as fp32 in the file)
        self.subs, self.swapper, self.buffers, self.dtype = subs, swapper, buffers, dtype
        self.device = buffers.device
        self.numel = subs[-1].stop if subs else 0
        self.empty = True  # nothing written since the last step: the first contribution starts from zero
        self._norm: Optional[torch.Tensor] = None
        for sub in subs:
            swapper.reserve(sub, "grad")

    def _load(self, into: torch.Tensor) -> None:
        for sub in self.subs:
            started = time.perf_counter()
            self.swapper.read_grad(sub, into[sub.start : sub.stop])  # staged on the host, copied to the device
            crossed(sub.numel * into.element_size(), False, started)

    def _store(self, values: torch.Tensor, final: bool = False) -> None:
        for sub in self.subs:
            started = time.perf_counter()
            self.swapper.write_grad(sub, values[sub.start : sub.stop], final)  # copied to a host buffer
            crossed(sub.numel * values.element_size(), True, started)
        self.empty = False

    def accumulate(self, reduced: torch.Tensor, alpha: float, final: bool) -> None:
        """``final``: the step's last contribution (its norm is taken now, of the values written)."""
        work = self.buffers.acquire(self.numel, self.dtype)
        try:
            if self.empty:
                work.zero_()
            else:
                self._load(work)
            work.add_(reduced.to(work.device), alpha=alpha)
            self._norm = shard_norm(work) if final else None
            self._store(work, final)
        finally:
            self.buffers.release(work)

    def norm(self) -> torch.Tensor:
        if self.empty:
            return torch.zeros((), dtype=torch.float32, device=self.device)
        if self._norm is None:  # written, but not by a final contribution (a set_full_grad, an interrupted step)
            self._norm = shard_norm(self.read())
        return self._norm

    def read(self) -> torch.Tensor:
        """A copy of the whole shard, read back from the file (for the rare readers: safe_get_full_grad, the
        gradient check, the first non-finite element's name)."""
        values = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        if self.empty:
            return values.zero_()
        self._load(values)
        return values

    def write(self, start: int, values: torch.Tensor) -> None:
        whole = self.read()
        whole[start : start + values.numel()].copy_(values)
        self._norm = None
        self._store(whole)

    def clear(self) -> None:
        self.empty, self._norm = True, None

    def resident(self) -> Optional[torch.Tensor]:
        return None

    def bytes(self) -> dict[str, int]:
        return {"nvme": self.numel * 4}
