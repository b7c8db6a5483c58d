"""torch.distributed's call signatures (``group=None`` is the world, a torch ``ProcessGroup`` is accepted) over
zeroshard's collectives, so calls made the torch way are still counted by the ledger, traced, and fail with an
error naming the rank and operation. Served to DeepSpeed clients as ``deepspeed.comm``."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from .backend import destroy, local_rank
from .backend import get_rank as _get_rank
from .backend import get_world_size as _get_world_size
from .backend import is_initialized as _is_initialized
from .collectives import Pending
from .collectives import all_gather as _all_gather
from .collectives import all_reduce as _all_reduce
from .collectives import all_to_all as _all_to_all
from .collectives import barrier as _barrier
from .collectives import broadcast as _broadcast
from .collectives import gather as _gather
from .collectives import recv as _recv
from .collectives import reduce as _reduce
from .collectives import reduce_scatter as _reduce_scatter
from .collectives import scatter as _scatter
from .collectives import send as _send
from .context import DEFAULT_CONTEXT
from .groups import Group, group_of, new_process_group

_OPS = {ReduceOp.SUM: "sum", ReduceOp.MAX: "max", ReduceOp.MIN: "min"}


def _group(group) -> Group:
    if isinstance(group, Group):
        return group
    return group_of(group, "world" if group is None or group is dist.group.WORLD else "user")


def _op(op) -> str:
    try:
        return _OPS[op]
    except KeyError:
        raise ValueError(f"deepspeed.comm: reduce op {op} is not supported (SUM, MAX or MIN)") from None


def _unflatten_into(outputs: list[torch.Tensor], flat: torch.Tensor) -> None:
    """The list forms run one flat collective; equal chunks of its output go back to the caller's tensors."""
    for out, chunk in zip(outputs, flat.chunk(len(outputs))):
        out.copy_(chunk.view_as(out))


def _result(pending: Pending, async_op: bool):
    return pending if async_op else None


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
    return _result(_all_reduce(tensor, _group(group), op=_op(op), async_op=async_op), async_op)


def inference_all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None):
    return all_reduce(tensor, op=op, group=group)


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False):
    return _result(_broadcast(tensor, src, _group(group), async_op=async_op), async_op)


def broadcast_object_list(object_list: list, src: int = 0, group=None, device=None) -> None:
    """``object_list`` filled in place with rank ``src``'s objects, as torch's call, but sent as JSON rather than
    pickled: plain data only (strings, numbers, booleans, None, lists, dicts with string keys; tuples arrive as
    lists), so no rank runs code another sent. Anything else is a ``TypeError`` naming it, on ``src``."""
    from ..accelerator import get_accelerator

    where = device if device is not None else get_accelerator().device(local_rank())
    chosen = _group(group)
    payload, refusal = b"", ""
    if get_rank() == src:
        try:
            payload = json.dumps(list(object_list), allow_nan=True).encode()
        except (TypeError, ValueError) as err:
            refusal = str(err)
    # the size goes first; -1 tells the other ranks that src refused, so every rank raises instead of waiting
    size = torch.tensor([-1 if refusal else len(payload)], dtype=torch.int64, device=where)
    _broadcast(size, src, chosen).wait()
    if int(size.item()) < 0:
        raise TypeError(
            f"broadcast_object_list: only plain data is sent (JSON, never pickled); rank {src}'s list is not: "
            f"{refusal or 'see that rank'}"
        )
    data = torch.empty(int(size.item()), dtype=torch.uint8, device=where)
    if get_rank() == src:
        data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    _broadcast(data, src, chosen).wait()
    received = json.loads(data.cpu().numpy().tobytes().decode())
    if len(received) != len(object_list):
        raise ValueError(
            f"broadcast_object_list: rank {src} sent {len(received)} objects, this rank's list holds "
            f"{len(object_list)}; every rank passes a list of the same length"
        )
    object_list[:] = received


def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group=None, async_op=False):
    return _result(_all_gather(output_tensor, input_tensor, _group(group), async_op=async_op), async_op)


def reduce_scatter_tensor(
    output_tensor: torch.Tensor, input_tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False
):
    if _op(op) != "sum":
        raise ValueError("deepspeed.comm.reduce_scatter_tensor: only ReduceOp.SUM is supported")
    return _result(_reduce_scatter(output_tensor, input_tensor, _group(group), async_op=async_op), async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group=None, async_op: bool = False):
    """The list form, through one flat all-gather (completed before returning; the handle is already done)."""
    flat = torch.empty(len(tensor_list) * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    pending = _all_gather(flat, tensor.contiguous().view(-1), _group(group))
    _unflatten_into(tensor_list, flat)
    return _result(pending, async_op)


def reduce(tensor: torch.Tensor, dst: int, op=ReduceOp.SUM, group=None, async_op: bool = False):
    return _result(_reduce(tensor, dst, _group(group), op=_op(op), async_op=async_op), async_op)


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op=ReduceOp.SUM, group=None, async_op=False):
    """The list form: ``input_list[i]`` summed over the ranks lands on the i-th rank."""
    return reduce_scatter_tensor(output, torch.cat([t.reshape(-1) for t in input_list]), op, group, async_op)


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes=None,
    input_split_sizes=None,
    group=None,
    async_op: bool = False,
):
    if output_split_sizes is not None or input_split_sizes is not None:
        raise ValueError("deepspeed.comm.all_to_all_single: uneven split sizes are not supported (equal chunks only)")
    return _result(_all_to_all(output, input, _group(group), async_op=async_op), async_op)


def all_to_all(
    output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor], group=None, async_op=False
):
    """The list form, through one flat exchange (completed before returning)."""
    flat_in = torch.cat([t.reshape(-1) for t in input_tensor_list])
    flat_out = torch.empty_like(flat_in)
    pending = _all_to_all(flat_out, flat_in, _group(group))
    _unflatten_into(output_tensor_list, flat_out)
    return _result(pending, async_op)


def gather(tensor: torch.Tensor, gather_list=None, dst: int = 0, group=None, async_op: bool = False):
    return _result(_gather(tensor, gather_list, dst, _group(group)), async_op)


def scatter(tensor: torch.Tensor, scatter_list=None, src: int = 0, group=None, async_op: bool = False):
    return _result(_scatter(tensor, scatter_list, src, _group(group)), async_op)


def send(tensor: torch.Tensor, dst: int, group=None, tag: int = 0) -> None:
    _send(tensor, dst, _group(group), tag)


def recv(tensor: torch.Tensor, src: int, group=None, tag: int = 0) -> int:
    _recv(tensor, src, _group(group), tag)
    return src


def isend(tensor: torch.Tensor, dst: int, group=None, tag: int = 0):
    return _send(tensor, dst, _group(group), tag, async_op=True)


def irecv(tensor: torch.Tensor, src: int, group=None, tag: int = 0):
    return _recv(tensor, src, _group(group), tag, async_op=True)


def barrier(group=None, async_op: bool = False, device_ids=None) -> None:
    _barrier(_group(group))


def monitored_barrier(group=None, timeout=None, wait_all_ranks: bool = False) -> None:
    """A barrier; a rank that does not arrive already fails with an error naming the rank and the group."""
    _barrier(_group(group))


def get_all_ranks_from_group(group=None) -> list[int]:
    return list(_group(group).ranks)


def get_rank(group=None) -> int:
    if group is None or not is_initialized():
        return _get_rank()
    if isinstance(group, Group):
        return group.rank
    return dist.get_rank(group)


def get_world_size(group=None) -> int:
    if group is None or not is_initialized():
        return _get_world_size()
    if isinstance(group, Group):
        return group.size
    return dist.get_world_size(group)


def get_local_rank() -> int:
    return local_rank()


def get_global_rank(group=None, group_rank: int = 0) -> int:
    return dist.get_global_rank(group, group_rank) if group is not None else group_rank


def is_initialized() -> bool:
    return _is_initialized()


def is_available() -> bool:
    return dist.is_available()


def new_group(ranks):
    return new_process_group(ranks)


def get_world_group():
    return dist.group.WORLD


def destroy_process_group(group=None) -> None:
    if group is None:
        destroy()
    else:
        dist.destroy_process_group(group)


def log_summary(show_straggler: bool = False) -> str:
    """Print (and return) the ledger's bytes and calls per (op, group)."""
    text = DEFAULT_CONTEXT.ledger.format()
    print(text)
    return text


__all__ = [
    "ReduceOp",
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "destroy_process_group",
    "gather",
    "get_all_ranks_from_group",
    "get_global_rank",
    "get_local_rank",
    "get_rank",
    "get_world_group",
    "get_world_size",
    "inference_all_reduce",
    "irecv",
    "is_available",
    "is_initialized",
    "isend",
    "log_summary",
    "monitored_barrier",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "send",
]
