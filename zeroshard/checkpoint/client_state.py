"""``client_state``: the caller's own values in a checkpoint, JSON plus tensors, never pickled.

Tensors (Lightning keeps e.g. ``ModelCheckpoint``'s best score as one) are stored in rank 0's safetensors file
under ``client.N`` and referenced from the JSON by ``{"__zeroshard_tensor__": "client.N"}``."""

from __future__ import annotations

import json
from typing import Any, Optional

import torch

from .reading import Sources


def json_ready(value: Any, where: str) -> Any:
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as err:
        raise TypeError(f"{where} must be JSON-serializable (checkpoints never pickle): {err}") from None


_TENSOR_MARK = "__zeroshard_tensor__"


def split_client_state(client_state: Optional[dict]) -> tuple[dict, dict[str, torch.Tensor]]:
    """``client_state`` as JSON with each tensor replaced by a reference, and the tensors by reference name: the
    tensors are stored in rank 0's safetensors file (Lightning keeps e.g. ``ModelCheckpoint``'s best score there
    as a tensor), never pickled."""
    tensors: dict[str, torch.Tensor] = {}

    def strip(value: Any) -> Any:
        if torch.is_tensor(value):
            name = f"client.{len(tensors)}"
            tensors[name] = value.detach().to("cpu").contiguous()
            return {_TENSOR_MARK: name}
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [strip(v) for v in value]
        return value

    return json_ready(strip(client_state or {}), "client_state"), tensors


def restore_client_state(client: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(client, dict):
        if set(client) == {_TENSOR_MARK} and client[_TENSOR_MARK] in tensors:
            return tensors[client[_TENSOR_MARK]]
        return {k: restore_client_state(v, tensors) for k, v in client.items()}
    if isinstance(client, list):
        return [restore_client_state(v, tensors) for v in client]
    return client


def read_client_tensors(sources: Sources, manifest: dict) -> dict[str, torch.Tensor]:
    """The client-state tensors of a checkpoint, verified against their checksums."""
    return {
        name: sources.read(entry["file"], entry["key"]).view(entry["shape"]).clone()
        for name, entry in manifest.get("client_tensors", {}).items()
    }
