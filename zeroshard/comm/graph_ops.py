"""The collectives of :mod:`.autograd` as custom operators (``torch.library``), so that compiled code can hold them.

Note [collectives in compiled code]: dynamo cannot trace a collective (its ledger entry, its async handle, its
timeout): met inside a compiled region, one would end the graph there. As an operator taking the :class:`Group` (an
opaque reference object to the compiler: a graph input it never traces into, guarded on the group's name and ranks),
a collective is one node of the graph; its fake implementation gives the output's shape, and when the graph runs it
is the same counted collective an eager call makes. The differentiable functions of ``autograd.py`` call these in
their forward and backward, so one implementation serves eager and compiled code, and a tensor-parallel layer
compiles to one graph. Every other collective (``collectives.py``, ``compressed.py``) is ``torch.compiler.disable``:
called from compiled code (a mixture-of-experts router's count exchange) it ends the graph there, by name, and runs
eagerly; dynamo never traces into one (where it could rewrite the torch call into the graph past the ledger).
"""

from __future__ import annotations

import torch
from torch._library.opaque_object import MemberType, register_opaque_type

from .collectives import all_gather, all_reduce, all_to_all, all_to_all_uneven
from .groups import Group

register_opaque_type(
    Group,
    typ="reference",
    guard_fn=lambda group: [group.name, group.ranks],
    members={name: MemberType.USE_REAL for name in ("size", "rank", "name", "ranks", "handle", "context", "partition")},
)


@torch.library.custom_op("zeroshard::all_reduce_sum", mutates_args=())
def all_reduce_sum(x: torch.Tensor, group: Group) -> torch.Tensor:
    """The sum of ``x`` over the group's ranks, in a new tensor."""
    summed = x.contiguous().clone()
    all_reduce(summed, group)
    return summed


@all_reduce_sum.register_fake
def _(x: torch.Tensor, group: Group) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("zeroshard::all_gather_stacked", mutates_args=())
def all_gather_stacked(x: torch.Tensor, group: Group, size: int) -> torch.Tensor:
    """Every rank's ``x``, stacked in rank order (``size``: the group's)."""
    gathered = x.new_empty((size, *x.shape))
    all_gather(gathered, x.contiguous(), group)
    return gathered


@all_gather_stacked.register_fake
def _(x: torch.Tensor, group: Group, size: int) -> torch.Tensor:
    return x.new_empty((size, *x.shape))


@torch.library.custom_op("zeroshard::all_to_all_stacked", mutates_args=())
def all_to_all_stacked(sends: torch.Tensor, group: Group) -> torch.Tensor:
    """``sends[j]`` to the group's j-th rank; what rank j sent here at ``[j]``."""
    received = torch.empty_like(sends, memory_format=torch.contiguous_format)
    all_to_all(received, sends.contiguous(), group)
    return received


@all_to_all_stacked.register_fake
def _(sends: torch.Tensor, group: Group) -> torch.Tensor:
    return torch.empty_like(sends, memory_format=torch.contiguous_format)


@torch.library.custom_op("zeroshard::all_to_all_rows", mutates_args=())
def all_to_all_rows(x: torch.Tensor, group: Group, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
    """Rows of ``x`` in ``input_splits`` counts to the group's ranks; ``output_splits`` rows from each, in rank
    order."""
    received = x.new_empty((sum(output_splits), *x.shape[1:]))
    all_to_all_uneven(received, x.contiguous(), output_splits, input_splits, group)
    return received


@all_to_all_rows.register_fake
def _(x: torch.Tensor, group: Group, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
    return x.new_empty((sum(output_splits), *x.shape[1:]))
