"""Where weights come from (``pretrained=``, TP inference), read one slice at a time so a rank holds only its shards.

A source answers ``read(name, dim, start, stop)``: the tensor ``name`` narrowed to [start, stop) along
``dim`` (the whole tensor when ``dim`` is None). Safetensors files read only the slice's bytes when
it is contiguous (rows of a row-major weight) and otherwise one whole tensor at a time; a zeroshard
training checkpoint assembles one fp32 parameter from its saved shards at a time.
"""

from __future__ import annotations

import os
from typing import Optional, Union

import torch
from torch import nn

from .consolidate import CheckpointTensors
from .manifest import plain_name
from .reading import load_json
from .safetensors_io import CheckpointError, Reader


class WeightSource:
    names: set[str]

    def shape(self, name: str) -> tuple[int, ...]:
        """The whole tensor's shape, known before any of it is read."""
        raise NotImplementedError

    def read(self, name: str, dim: Optional[int] = None, start: int = 0, stop: Optional[int] = None) -> torch.Tensor:
        raise NotImplementedError

    def close(self) -> None:
        pass


def _narrow(tensor: torch.Tensor, dim: Optional[int], start: int, stop: Optional[int]) -> torch.Tensor:
    if dim is None:
        return tensor
    stop = tensor.shape[dim] if stop is None else stop
    return tensor.narrow(dim, start, stop - start)


class StateDictSource(WeightSource):
    def __init__(self, state: dict[str, torch.Tensor]):
        self.state = state
        self.names = set(state)

    def shape(self, name):
        return tuple(self.state[name].shape)

    def read(self, name, dim=None, start=0, stop=None):
        return _narrow(self.state[name], dim, start, stop)


class ModuleSource(WeightSource):
    """The model's own (materialized) tensors, as they were before sharding; released on close."""

    def __init__(self, model: nn.Module):
        self.tensors = dict(model.named_parameters(remove_duplicate=False))
        self.tensors.update(model.named_buffers(remove_duplicate=False))
        self.names = set(self.tensors)

    def shape(self, name):
        return tuple(self.tensors[name].shape)

    def read(self, name, dim=None, start=0, stop=None):
        tensor = self.tensors[name]
        if tensor.is_meta:
            raise CheckpointError(f"'{name}' is on the meta device: pass checkpoint= to load the weights")
        return _narrow(tensor.detach(), dim, start, stop)

    def close(self):
        self.tensors.clear()


class SafetensorsSource(WeightSource):
    """One ``.safetensors`` file, or a Hugging Face directory (``model.safetensors`` or an index of shards)."""

    def __init__(self, path: str):
        if os.path.isdir(path):
            index = os.path.join(path, "model.safetensors.index.json")
            if os.path.isfile(index):
                try:
                    items = load_json(index)["weight_map"].items()
                except (KeyError, TypeError, AttributeError) as err:
                    raise CheckpointError(f"{index}: not a safetensors index with a 'weight_map' ({err!r})") from None
                files = {name: os.path.join(path, plain_name(file, "weight_map file", index)) for name, file in items}
            elif os.path.isfile(os.path.join(path, "model.safetensors")):
                files = None
                path = os.path.join(path, "model.safetensors")
            else:
                raise CheckpointError(
                    f"checkpoint directory {path} has neither model.safetensors nor model.safetensors.index.json "
                    "nor a zeroshard 'latest' file"
                )
        else:
            files = None
        if files is None:
            reader = Reader(path)
            files = dict.fromkeys(reader.keys(), path)
            self.readers = {path: reader}
        else:
            self.readers = {}
        self.files = files
        self.names = set(files)

    def _reader(self, file: str) -> Reader:
        if file not in self.readers:
            self.readers[file] = Reader(file)
        return self.readers[file]

    def shape(self, name):
        return tuple(self._reader(self.files[name]).entry(name)["shape"])

    def read(self, name, dim=None, start=0, stop=None):
        reader = self._reader(self.files[name])
        shape = reader.entry(name)["shape"]
        if dim == 0 or (dim is not None and all(s == 1 for s in shape[:dim])):
            row = torch.Size(shape[dim + 1 :]).numel()
            stop = shape[dim] if stop is None else stop
            return reader.read(name, start * row, stop * row).view(*shape[:dim], stop - start, *shape[dim + 1 :])
        return _narrow(reader.read_tensor(name), dim, start, stop)

    def close(self):
        for reader in self.readers.values():
            reader.close()


class ZeroCheckpointSource(WeightSource):
    """A zeroshard training checkpoint: the fp32 master weights (and buffers), one tensor assembled at a time."""

    def __init__(self, path: str, tag: Optional[str] = None):
        self.tensors = CheckpointTensors(path, tag)
        self.names = self.tensors.names

    def shape(self, name):
        return self.tensors.shape(name)

    def read(self, name, dim=None, start=0, stop=None):
        return _narrow(self.tensors.read(name), dim, start, stop)

    def close(self):
        self.tensors.close()


def open_source(checkpoint: Union[None, dict, str, os.PathLike], model: nn.Module) -> WeightSource:
    if checkpoint is None:
        return ModuleSource(model)
    if isinstance(checkpoint, dict):
        return StateDictSource(checkpoint)
    if not isinstance(checkpoint, (str, os.PathLike)):
        raise TypeError(
            f"checkpoint must be a state dict or a path, got {type(checkpoint).__name__}"
            " (a safetensors file, a Hugging Face checkpoint directory, or a zeroshard checkpoint directory)"
        )
    path = os.fspath(checkpoint)
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "latest")):
        return ZeroCheckpointSource(path)
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "manifest.json")):  # one tag of a checkpoint
        parent, tag = os.path.split(os.path.normpath(path))
        return ZeroCheckpointSource(parent, tag)
    return SafetensorsSource(path)
