"""What one pipeline stage tells the next before sending it activations, pure: the shapes, dtypes and requires-grad
flags of the tensors that follow, so the receiver allocates exactly what arrives and no stage ever waits for a
message of another size (diffusion-pipe's 3-stage hang came from stages exchanging tensors of mixed dtypes that the
receiver guessed).

A stage's output is one tensor or a tuple of them (an fp32 activation, an int64 mask, a bf16 embedding, ...). Its
header is a 1-D int64 tensor: ``[MAGIC, single, count, (dtype code, requires_grad, ndim, *shape) per tensor]``.
The engine sends its length, then the header, then the tensors; :func:`parse` checks a received header completely
(codes, lengths, sizes) before anything is allocated from it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Union

import torch

MAGIC = 0x5A5350  # "ZSP"
MAX_TENSORS = 64
MAX_DIMS = 8
MAX_ELEMENTS = 1 << 40
DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)


class PipeMessageError(ValueError):
    """A stage output that cannot be announced, or a received header that does not describe one."""


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


@dataclass(frozen=True)
class Announcement:
    """What follows: ``tensors`` in order; ``single``: the stage returned one tensor, not a tuple."""

    tensors: tuple[TensorMeta, ...]
    single: bool


Output = Union[torch.Tensor, tuple]


def announce(output: Output) -> Announcement:
    """The announcement of a stage's ``output`` (a tensor or a tuple of tensors)."""
    single = isinstance(output, torch.Tensor)
    tensors = (output,) if single else output
    if not isinstance(tensors, tuple) or not 1 <= len(tensors) <= MAX_TENSORS:
        raise PipeMessageError(
            f"a pipeline stage returns a tensor or a tuple of 1 to {MAX_TENSORS} tensors, got {_kind(output)}"
        )
    metas = []
    for i, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor):
            raise PipeMessageError(f"element {i} of a pipeline stage's output is {_kind(tensor)}, not a tensor")
        if tensor.dtype not in DTYPES or tensor.dim() > MAX_DIMS:
            raise PipeMessageError(
                f"element {i} of a pipeline stage's output ({tensor.dtype}, {tensor.dim()} dims) cannot be sent "
                f"between stages: dtypes {[str(d).removeprefix('torch.') for d in DTYPES]}, at most {MAX_DIMS} dims"
            )
        metas.append(TensorMeta(tuple(tensor.shape), tensor.dtype, tensor.requires_grad))
    return Announcement(tuple(metas), single)


def encode(announcement: Announcement) -> torch.Tensor:
    """The header of ``announcement``: a 1-D int64 tensor."""
    fields = [MAGIC, int(announcement.single), len(announcement.tensors)]
    for meta in announcement.tensors:
        fields += [DTYPES.index(meta.dtype), int(meta.requires_grad), len(meta.shape), *meta.shape]
    return torch.tensor(fields, dtype=torch.int64)


def parse(header: torch.Tensor, sender: str = "the previous stage") -> Announcement:
    """The announcement a received ``header`` describes; any inconsistency is a :class:`PipeMessageError` naming
    ``sender``."""
    if header.dtype != torch.int64 or header.dim() != 1 or header.numel() < 3:
        raise PipeMessageError(f"the header from {sender} is not a 1-D int64 tensor of at least 3 fields")
    fields = header.tolist()
    magic, single, count = fields[:3]
    if magic != MAGIC or single not in (0, 1) or not 1 <= count <= MAX_TENSORS or (single and count != 1):
        raise PipeMessageError(f"the header from {sender} is not a pipeline announcement: {fields[:3]}")
    at, metas = 3, []
    for i in range(count):
        if at + 3 > len(fields):
            raise PipeMessageError(f"the header from {sender} ends inside tensor {i} of {count}")
        code, grad, ndim = fields[at : at + 3]
        shape = tuple(fields[at + 3 : at + 3 + ndim]) if 0 <= ndim <= MAX_DIMS else ()
        if not 0 <= code < len(DTYPES) or grad not in (0, 1) or not 0 <= ndim <= MAX_DIMS or len(shape) != ndim:
            raise PipeMessageError(f"the header from {sender} describes tensor {i} badly: {fields[at : at + 3]}")
        if any(d < 0 for d in shape) or math.prod(shape) > MAX_ELEMENTS:
            raise PipeMessageError(f"the header from {sender} gives tensor {i} the shape {list(shape)}")
        if grad and not DTYPES[code].is_floating_point:
            raise PipeMessageError(f"the header from {sender} asks a gradient of {DTYPES[code]} tensor {i}")
        metas.append(TensorMeta(shape, DTYPES[code], bool(grad)))
        at += 3 + ndim
    if at != len(fields):
        raise PipeMessageError(f"the header from {sender} holds {len(fields) - at} fields past its {count} tensors")
    return Announcement(tuple(metas), bool(single))


def _kind(value) -> str:
    return f"a {type(value).__name__}"
