"""From a sharded checkpoint to one fp32 state dict or safetensors files, one tensor at a time.

Peak memory is the largest parameter plus a fixed read buffer, whatever the model size: each
parameter is assembled from its saved pieces, written, and dropped before the next.
"""

from __future__ import annotations

import json
import os
import re
from typing import Optional, Union

import torch
from tqdm import tqdm

from ..accelerator import release_host_memory
from ..partition import assign_buckets
from ..precision import DTYPE_NAMES
from .client_state import read_client_tensors, restore_client_state
from .reading import Sources, read_manifest, read_parameter, resolve_tag
from .safetensors_io import CheckpointError, write

PathLike = Union[str, os.PathLike]  # every path argument: a str or a pathlib.Path

_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(size: Union[int, str]) -> int:
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)\s*", size.upper())
    if not match:
        raise ValueError(f"max_shard_size {size!r}: expected bytes or a string like '5GB' or '500MB'")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def _open(checkpoint_dir: PathLike, tag: Optional[str]) -> tuple[Sources, dict]:
    checkpoint_dir = os.fspath(checkpoint_dir)
    tag = resolve_tag(checkpoint_dir, tag)
    if tag is None:
        raise CheckpointError(f"{checkpoint_dir} has no 'latest' file; pass tag=")
    path = os.path.join(checkpoint_dir, tag)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    manifest = read_manifest(path)
    return Sources(path, manifest), manifest


def _entries(manifest: dict) -> list[tuple[str, tuple, str]]:
    """(name, shape, where) in a stable order: trained parameters, then frozen parameters and buffers."""
    out = [(n, tuple(e["shape"]), "param") for n, e in manifest["params"].items()]
    out += [(n, tuple(e["shape"]), "module") for n, e in manifest["module_tensors"].items()]
    return out


def _materialize(sources: Sources, manifest: dict, name: str, shape: tuple, where: str) -> torch.Tensor:
    if where == "param":
        return read_parameter(sources, name).float()
    value = sources.read_whole(name, manifest["module_tensors"][name])
    return value.float() if value.is_floating_point() else value


class CheckpointTensors:
    """A checkpoint's fp32 weights and buffers by name, tied aliases included; each ``read`` assembles one
    tensor from its saved shards, so a reader holds one tensor at a time."""

    def __init__(self, checkpoint_dir: PathLike, tag: Optional[str] = None):
        self.sources, self.manifest = _open(checkpoint_dir, tag)
        self.entries = {name: (name, shape, where) for name, shape, where in _entries(self.manifest)}
        self.aliases = self.manifest.get("aliases", {})

    @property
    def names(self) -> set[str]:
        return set(self.entries) | set(self.aliases)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[self.aliases.get(name, name)][1]

    def read(self, name: str) -> torch.Tensor:
        return _materialize(self.sources, self.manifest, *self.entries[self.aliases.get(name, name)])

    def close(self) -> None:
        self.sources.close()


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: PathLike, tag: Optional[str] = None
) -> dict[str, torch.Tensor]:
    """The fp32 master weights (and buffers) of a checkpoint as one state dict, tied names included."""
    tensors = CheckpointTensors(checkpoint_dir, tag)
    try:
        state = {name: tensors.read(name) for name in tensors.entries}
    finally:
        tensors.close()
    for alias, name in tensors.aliases.items():
        state[alias] = state[name]
    return state


def read_client_state(checkpoint_dir: PathLike, tag: Optional[str] = None) -> dict:
    """The ``client_state`` saved with a checkpoint (tensors included), without building an engine."""
    sources, manifest = _open(checkpoint_dir, tag)
    try:
        return restore_client_state(manifest["client_state"], read_client_tensors(sources, manifest))
    finally:
        sources.close()


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir: PathLike, tag: Optional[str] = None):
    """Load the checkpoint's fp32 weights into a plain (unsharded) model; returns the model."""
    model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag), strict=True)
    return model


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: PathLike,
    output_path: PathLike,
    tag: Optional[str] = None,
    max_shard_size: Union[int, str] = "5GB",
    progress: bool = False,
    safe_serialization: bool = True,
    dtype: Union[str, torch.dtype] = torch.float32,
) -> list[str]:
    """Write the fp32 weights as safetensors, streaming one tensor at a time (``dtype``: the floating-point tensors
    in fp16 or bf16 instead, as DeepSpeed 0.19.8's ``zero_to_torch --dtype``; integer buffers keep theirs).

    ``output_path`` ending in ``.safetensors`` names a single file; otherwise it is a directory that
    receives ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` files plus
    ``model.safetensors.index.json`` when the weights exceed ``max_shard_size`` (the layout
    Hugging Face ``from_pretrained`` reads). Tied names are written once, as in HF. ``progress`` shows a
    bar of bytes written (the ``zeroshard convert`` CLI turns it on). Returns the files.

    Without ``safe_serialization`` (DeepSpeed's default in its own ``zero_to_fp32``) the files are torch's:
    ``pytorch_model.bin`` (or ``.bin`` shards and ``pytorch_model.bin.index.json``), a dict of tensors and nothing
    else, so ``torch.load(..., weights_only=True)`` reads it; tied names are both there as one shared tensor (as
    DeepSpeed writes them); each file's tensors are held in memory to write it.
    """
    limit = parse_size(max_shard_size)
    floating = output_dtype(dtype)
    suffix, stem = (".safetensors", "model") if safe_serialization else (".bin", "pytorch_model")
    checkpoint_dir, output_path = os.fspath(checkpoint_dir), os.fspath(output_path)
    _check_outside(output_path, checkpoint_dir)
    sources, manifest = _open(checkpoint_dir, tag)
    entries = _entries(manifest)
    specs_of = [_dtype_of(manifest, entry, floating) for entry in entries]
    sizes = [torch.Size(shape).numel() * d.itemsize for (_, shape, _), d in zip(entries, specs_of)]
    shards = assign_buckets(sizes, limit) or [[]]  # consecutive files of at most ``limit`` bytes
    single_file = output_path.endswith(suffix)
    if single_file and len(shards) > 1:
        sources.close()
        raise ValueError(
            f"the weights ({sum(sizes)} bytes) exceed max_shard_size {max_shard_size}: "
            "pass a directory as output_path to get sharded files"
        )
    directory = os.path.dirname(output_path) if single_file else output_path
    os.makedirs(directory or ".", exist_ok=True)
    names = _file_names(output_path if single_file else None, stem, suffix, len(shards))
    written, weight_map = [], {}
    aliases = None if safe_serialization else manifest.get("aliases", {})
    bar = tqdm(total=sum(sizes), unit="B", unit_scale=True, desc="convert", disable=not progress)
    try:
        for file_name, members in zip(names, shards):
            specs = [(entries[i][0], specs_of[i], entries[i][1]) for i in members]
            path = os.path.join(directory, file_name)
            tensors = _stream(sources, manifest, [entries[i] for i in members], specs_of, members, sizes, bar)
            _write_weights(path, tensors, specs, aliases)
            written.append(path)
            weight_map.update({entries[i][0]: file_name for i in members})
        if not safe_serialization:  # torch's files hold the tied names too
            weight_map.update({a: weight_map[t] for a, t in manifest.get("aliases", {}).items() if t in weight_map})
    finally:
        bar.close()
        sources.close()
    if len(names) > 1:
        written.append(_write_index(os.path.join(directory, f"{stem}{suffix}.index.json"), sum(sizes), weight_map))
    return written


def _stream(sources: Sources, manifest: dict, entries: list, dtypes: list, members: list, sizes: list, bar):
    """The tensors of one output file, whole, one at a time (``members``: their indices among all entries)."""
    for entry, i in zip(entries, members):
        yield entry[0], _materialize(sources, manifest, *entry).to(dtypes[i])
        bar.update(sizes[i])
        release_host_memory()  # one tensor at a time means nothing freed should stay resident


def _file_names(single_file: Optional[str], stem: str, suffix: str, count: int) -> list[str]:
    """The output files' names: the one asked for, ``<stem><suffix>``, or ``count`` numbered shards."""
    if single_file is not None:
        return [os.path.basename(single_file)]
    if count == 1:
        return [f"{stem}{suffix}"]
    return [f"{stem}-{i + 1:05d}-of-{count:05d}{suffix}" for i in range(count)]


def _write_index(path: str, total_size: int, weight_map: dict) -> str:
    """Hugging Face's index of sharded weights (which file holds each name)."""
    with open(path, "w") as f:
        json.dump({"metadata": {"total_size": total_size}, "weight_map": weight_map}, f, indent=2)
    return path


def _write_weights(path: str, tensors, specs: list, aliases: Optional[dict]) -> None:
    """One weights file, written beside ``path`` and renamed into place (never a partial file): safetensors
    streamed one tensor at a time; with ``aliases`` (tied name -> its tensor's name) torch's format, as DeepSpeed's
    ``zero_to_fp32`` writes it, a tied name being the same tensor, saved once by torch."""
    try:
        if aliases is None:
            write(path + ".tmp", tensors, specs, metadata={"format": "pt"})
        else:
            state = dict(tensors)
            state.update({alias: state[target] for alias, target in aliases.items() if target in state})
            torch.save(state, path + ".tmp")
    except BaseException:
        if os.path.exists(path + ".tmp"):
            os.remove(path + ".tmp")
        raise
    os.replace(path + ".tmp", path)


def _check_outside(output_path: str, checkpoint_dir: str) -> None:
    """Writing into a checkpoint would replace its files with the output (``convert CK CK/<tag>/rank00000.safetensors``
    once destroyed the checkpoint it read): an output inside any checkpoint directory of ``checkpoint_dir`` (one
    holding a manifest, or a save in progress), or onto its ``latest``, is refused. Beside them is fine."""
    output, root = os.path.realpath(output_path), os.path.realpath(checkpoint_dir)
    if os.path.commonpath([output, root]) != root:
        return
    relative = os.path.relpath(output, root)
    top = os.path.join(root, relative.split(os.sep)[0])  # the save_dir entry the output is in (root itself: ".")
    hidden_dir = os.path.basename(top).startswith(".") and os.path.isdir(top)  # root, or a save in progress
    if relative == "latest" or hidden_dir or os.path.isfile(os.path.join(top, "manifest.json")):
        raise ValueError(
            f"output {output_path} is inside the checkpoint being converted ({checkpoint_dir}): writing there would "
            "overwrite it; choose a path outside its tag directories and 'latest'"
        )


def _dtype_of(manifest: dict, entry: tuple, floating: torch.dtype) -> torch.dtype:
    """``floating`` for every floating-point tensor (fp32 unless asked: the consolidated weights are fp32), integer
    buffers as saved."""
    name, _, where = entry
    if where == "param":
        return floating
    dtype = getattr(torch, manifest["module_tensors"][name]["dtype"])
    return floating if dtype.is_floating_point else dtype


OUTPUT_DTYPES = ("fp32", "float32", "fp16", "float16", "bf16", "bfloat16")


def output_dtype(dtype: Union[str, torch.dtype]) -> torch.dtype:
    """A converter's output dtype, by torch dtype or name (``bf16``, ``torch.bfloat16``, ...; DeepSpeed's names)."""
    if isinstance(dtype, torch.dtype) and dtype in (torch.float32, torch.float16, torch.bfloat16):
        return dtype
    name = dtype.lower().removeprefix("torch.") if isinstance(dtype, str) else None
    if name not in OUTPUT_DTYPES:
        raise ValueError(f"output dtype {dtype!r}: choose one of {', '.join(OUTPUT_DTYPES)}")
    return DTYPE_NAMES[name]
