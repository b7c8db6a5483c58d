"""``deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine``: ``torch.save`` / ``torch.load`` behind
DeepSpeed's checkpoint-engine calls, with zeroshard's rules for files: a save is atomic (written beside the target,
fsynced, renamed), and a load unpickles tensors, containers and plain values only (``weights_only=True``): a file
holding anything else is refused naming the class, and nothing in it runs."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from zeroshard.checkpoint.commit import fsync_dir
from zeroshard.checkpoint.restricted_pickle import read_restricted_pickle


@dataclass
class CheckpointCommitInfo:
    tag: str
    save_dir: str
    save_latest: bool


class CheckpointEngine:
    """DeepSpeed's base class, for clients that subclass it."""

    def __init__(self, config_params: Any = None):
        self.name = None

    def create(self, info: CheckpointCommitInfo) -> None:
        pass

    def save(self, state_dict: Any, path: str) -> None:
        raise NotImplementedError(f"{type(self).__name__}.save")

    def load(self, path: str, map_location: Any = None) -> Any:
        raise NotImplementedError(f"{type(self).__name__}.load")

    def commit(self, info: CheckpointCommitInfo) -> bool:
        return True

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        os.makedirs(path, exist_ok=exist_ok)

    def is_data_parallel_writer(self, dp_rank: int) -> bool:
        return dp_rank == 0

    def is_decoupled(self) -> bool:
        return False

    def set_commit_info(self, info: CheckpointCommitInfo) -> None:
        pass

    def get_commit_info(self) -> None:
        return None

    def cleanup(self) -> None:
        pass

    def preserves_storage_sharing(self) -> bool:
        return True


class TorchCheckpointEngine(CheckpointEngine):
    def __init__(self, config_params: Any = None):
        super().__init__(config_params)
        self.name = "TorchCheckpointEngine"

    def save(self, state_dict: Any, path: str) -> None:
        """``torch.save`` into ``path`` atomically: a crash leaves the old file or none, never half a file."""
        path = os.fspath(path)
        tmp = f"{path}.tmp"
        with open(tmp, "wb") as f:
            torch.save(state_dict, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(path) or ".")

    def load(self, path: str, map_location: Any = None) -> Any:
        """``torch.load(path, weights_only=True)``: tensors, containers and plain values; any class is refused by
        name (DeepSpeed's engine loads with ``weights_only=False``, which runs whatever the file holds)."""
        holds = "TorchCheckpointEngine.load reads tensors, containers and plain values only"
        return read_restricted_pickle(os.fspath(path), holds, map_location=map_location)


__all__ = ["CheckpointCommitInfo", "CheckpointEngine", "TorchCheckpointEngine"]
