"""``client_state``: the caller's own values in a checkpoint, JSON plus tensors, never pickled.

Tensors (Lightning keeps e.g. ``ModelCheckpoint``'s best score as one) are stored in rank 0's safetensors file
under ``client.N`` and referenced from the JSON by ``{"__zeroshard_tensor__": "client.N"}``."""

from __future__ import annotations

import json
from typing import Any, Optional

import torch

from .manifest import ESCAPE_MARK as _ESCAPE_MARK
from .manifest import TENSOR_MARK as _TENSOR_MARK
from .reading import Sources
from .safetensors_io import NAMES


def json_ready(value: Any, where: str) -> Any:
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as err:
        raise TypeError(f"{where} must be JSON-serializable (checkpoints never pickle): {err}") from None


_MARKS = {_TENSOR_MARK, _ESCAPE_MARK}


def _storable(value: torch.Tensor, where: str) -> torch.Tensor:
    """A dense, real, materialized tensor, as a safetensors file stores it."""
    if value.is_meta:
        raise TypeError(f"{where} is a tensor on the meta device (it has no values to save)")
    if value.layout != torch.strided:
        raise TypeError(f"{where} is a {value.layout} tensor; save it dense (.to_dense())")
    if value.is_complex() or value.dtype not in NAMES:
        raise TypeError(
            f"{where} has dtype {value.dtype}, which a checkpoint cannot store (supported: "
            f"{', '.join(str(d).removeprefix('torch.') for d in NAMES)}); convert it, e.g. torch.view_as_real"
        )
    return value.detach().to("cpu").contiguous()


def split_client_state(client_state: Optional[dict]) -> tuple[dict, dict[str, torch.Tensor]]:
    """``client_state`` as JSON with each tensor replaced by a reference, and the tensors by reference name: the
    tensors are stored in rank 0's safetensors file (Lightning keeps e.g. ``ModelCheckpoint``'s best score there
    as a tensor), never pickled. A user dict holding a key the encoding reserves is escaped, so it comes back as
    the same dict, never as a tensor."""
    tensors: dict[str, torch.Tensor] = {}

    def strip(value: Any, where: str) -> Any:
        if torch.is_tensor(value):
            name = f"client.{len(tensors)}"
            tensors[name] = _storable(value, where)
            return {_TENSOR_MARK: name}
        if isinstance(value, dict):
            stripped = {k: strip(v, f"{where}[{k!r}]") for k, v in value.items()}
            return {_ESCAPE_MARK: stripped} if _MARKS & set(stripped) else stripped
        if isinstance(value, (list, tuple)):
            return [strip(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return value

    return json_ready(strip(client_state or {}, "client_state"), "client_state"), tensors


def restore_client_state(client: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(client, dict):
        if set(client) == {_TENSOR_MARK} and client[_TENSOR_MARK] in tensors:
            return tensors[client[_TENSOR_MARK]]
        if set(client) == {_ESCAPE_MARK} and isinstance(client[_ESCAPE_MARK], dict):
            client = client[_ESCAPE_MARK]
        return {k: restore_client_state(v, tensors) for k, v in client.items()}
    if isinstance(client, list):
        return [restore_client_state(v, tensors) for v in client]
    return client


def read_client_tensors(sources: Sources, manifest: dict) -> dict[str, torch.Tensor]:
    """The client-state tensors of a checkpoint, verified against their checksums."""
    return {name: sources.read_whole(name, entry).clone() for name, entry in manifest.get("client_tensors", {}).items()}
