"""The checkpoint manifest: which bytes of which file hold which part of which parameter (pure data).

Every parameter is described by its fully qualified name, global shape and a list of *pieces*:
(file, tensor key, offset in that tensor, offset in the flattened parameter, element count). Saved
shard ranges are derived from the layouts of the run that saved; a loader with another world size
or stage reads, for each of its own shard segments, exactly the pieces that overlap it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, conint, conlist, model_validator

from ..comm.mesh import ParallelDims
from ..partition import TensorSplit
from .safetensors_io import CheckpointError

FORMAT = "zeroshard-checkpoint/2"  # /2: the manifest and every file header carry checksums
_TORCH_DTYPES = {"float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool"}
_RANK_FILE = re.compile(r"rank\d{5}\.safetensors")
TENSOR_MARK = "__zeroshard_tensor__"  # in client_state, {TENSOR_MARK: "client.N"} stands for a saved tensor
ESCAPE_MARK = "__zeroshard_dict__"  # {ESCAPE_MARK: {...}} stands for a user dict that holds one of the marks
MAX_COUNTER = (1 << 63) - 1  # counters become int64 tensors and step numbers: a larger one is no real run's


def rank_file(rank: int, suffix: str = ".safetensors") -> str:
    """A rank's file in a checkpoint directory: its tensors (``.safetensors``), or its checksums while saving
    (``.json``, folded into the manifest)."""
    return f"rank{rank:05d}{suffix}"


@dataclass(frozen=True)
class Piece:
    file: str
    key: str  # tensor key without the state prefix, e.g. "fg3"
    tensor_offset: int
    param_offset: int
    numel: int

    def to_json(self) -> list:
        return [self.file, self.key, self.tensor_offset, self.param_offset, self.numel]

    @classmethod
    def from_json(cls, value: list) -> "Piece":
        return cls(*value)  # validated (types and bounds) by ``validate`` when the manifest was read


def plain_name(value: str, what: str, where: str) -> str:
    """A file name or tag must name an entry *inside* the checkpoint directory: no separators, no '..', not
    absolute. Anything else would let an edited manifest (or 'latest') read files from elsewhere."""
    if (
        not isinstance(value, str)
        or not value
        or value in (".", "..")
        or "/" in value
        or "\\" in value
        or (os.altsep and os.altsep in value)
        or "\x00" in value
    ):
        raise CheckpointError(f"{where}: {what} {value!r} is not a plain name inside the checkpoint directory")
    return value


# -- the manifest's schema: what a loader may rely on, checked before anything is read -----------------
NonNegative = conint(ge=0, strict=True)
Counter = conint(ge=0, le=MAX_COUNTER, strict=True)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Loose(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class FileEntry(_Strict):
    size: NonNegative
    header_crc: NonNegative
    crc: dict[str, NonNegative]


class ParamEntry(_Strict):
    pieces: list[conlist(Any, min_length=5, max_length=5)]
    shape: list[NonNegative]  # the full parameter's
    dtype: str
    # tensor parallelism: how the parameter was cut over the saving run's tensor-parallel ranks; its pieces then
    # cover the concatenation of every rank's piece, flattened, in rank order (see ``read_parameter``)
    split: Optional[dict] = None


class ModuleTensorEntry(_Strict):
    file: str
    key: str
    shape: list[NonNegative]
    dtype: str


class Counters(_Strict):
    global_steps: Counter
    global_samples: Counter
    skipped_steps: Counter
    micro_steps: Counter


class FlatGroupState(_Strict):
    group: NonNegative
    state_keys: list[str]
    scalars: dict[str, dict]


class OptimizerState(_Strict):
    param_groups: list[dict]
    flat_groups: list[FlatGroupState]
    type: Optional[str] = None  # the update rule (ZeroOptimizer.kind); absent in checkpoints before it was kept


class PipelineRecord(_Strict):
    stages: conint(ge=1, strict=True)
    parts: list[NonNegative]
    # [layer index, tie key or ""] of the layers DeepSpeed writes a file for; absent before it was kept
    layer_files: Optional[list[list]] = None

    @model_validator(mode="after")
    def _boundaries(self):
        if len(self.parts) != self.stages + 1 or self.parts[0] != 0 or self.parts != sorted(self.parts):
            raise ValueError(f"parts {self.parts} are not the increasing boundaries of {self.stages} stages")
        for entry in self.layer_files or []:
            index, key = (entry + [None, None])[:2] if len(entry) == 2 else (None, None)
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < self.parts[-1]:
                raise ValueError(f"layer_files entry {entry!r} is not [a layer index below {self.parts[-1]}, a key]")
            if not isinstance(key, str):
                raise ValueError(f"layer_files entry {entry!r}: the tie key is not a string")
        return self


class Manifest(_Loose):
    format: str
    tag: str
    world_size: conint(ge=1, strict=True)
    tensor_parallel_size: conint(ge=1, strict=True) = 1
    expert_parallel_size: conint(ge=1, strict=True) = 1
    sequence_parallel_size: conint(ge=1, strict=True) = 1  # where an expert rank's coordinate lies (see below)
    expert_tensor_ranks: conint(ge=1, strict=True) = 1  # tensor ranks per expert group (AutoEP folded with AutoTP)
    stage: conint(ge=0, le=3, strict=True)
    shard_group_size: conint(ge=1, strict=True)
    counters: Counters
    loss_scaler: Optional[dict]
    lr_scheduler: Any
    optimizer: OptimizerState
    params: dict[str, ParamEntry]
    module_tensors: dict[str, ModuleTensorEntry]
    files: dict[str, FileEntry]
    python_rng: dict[str, list]
    aliases: dict[str, str]
    config: dict
    client_state: dict
    client_tensors: dict[str, ModuleTensorEntry] = Field(default_factory=dict)  # tensors of client_state
    excluded_frozen: list[str] = Field(default_factory=list)  # saved with exclude_frozen_parameters
    sampler: Optional[dict] = Field(default=None)
    pipeline: Optional[PipelineRecord] = None  # saved by a pipeline: its stages and partition


def _digest(body: dict) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def seal(body: dict) -> dict:
    """The manifest as written: its body plus a checksum over it."""
    return {**body, "checksum": _digest(body)}


def validate(data: Any, where: str) -> dict:
    """Check a loaded manifest completely before any of it is used: its own checksum, its structure, and
    every piece against the parameter it fills and the file list. Returns the body (without the checksum).
    Each problem is a :class:`CheckpointError` naming ``where`` and the field."""
    if not isinstance(data, dict):
        raise CheckpointError(f"{where}: the manifest is a {type(data).__name__}, expected a JSON object")
    if data.get("format") != FORMAT:
        found = data.get("format")
        hint = " (written by an older zeroshard: load it with that version and save again)" if found else ""
        raise CheckpointError(f"{where}: unknown format {found!r}, expected {FORMAT!r}{hint}")
    body = {k: v for k, v in data.items() if k != "checksum"}
    try:
        expected = _digest(body)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{where}: the manifest holds values JSON cannot carry ({err})") from None
    if data.get("checksum") != expected:
        raise CheckpointError(f"{where}: the manifest fails its checksum (edited or damaged after it was written)")
    try:
        manifest = Manifest.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(part) for part in first["loc"])
        raise CheckpointError(f"{where}: field '{field}': {first['msg']}") from None
    for name in manifest.files:
        plain_name(name, "file", where)
        if not _RANK_FILE.fullmatch(name):
            raise CheckpointError(f"{where}: file {name!r} is not a rank file (rankNNNNN.safetensors)")
    for name, entry in manifest.params.items():
        if entry.dtype not in _TORCH_DTYPES:
            raise CheckpointError(f"{where}: parameter '{name}' has unknown dtype {entry.dtype!r}")
        sizes = {"tp": manifest.tensor_parallel_size, "ep": manifest.expert_parallel_size}
        _check_split(name, entry, sizes, where)
        _check_pieces(name, entry, manifest.files, where)
        _check_piece_ranks(name, entry, sizes, _saved_layout(manifest, where), where)
    _check_disjoint(manifest.params, where)
    for reference in _client_references(manifest.client_state):
        if reference not in manifest.client_tensors:
            raise CheckpointError(
                f"{where}: client_state refers to tensor {reference!r}, which 'client_tensors' does not list"
            )
    for kind, entries in (("module tensor", manifest.module_tensors), ("client_state tensor", manifest.client_tensors)):
        for name, entry in entries.items():
            if entry.file not in manifest.files:
                raise CheckpointError(f"{where}: {kind} '{name}' names file {entry.file!r}, not in 'files'")
            if entry.dtype not in _TORCH_DTYPES:
                raise CheckpointError(f"{where}: {kind} '{name}' has unknown dtype {entry.dtype!r}")
            plain_name(entry.file, "file", where)
    for rank, state in manifest.python_rng.items():
        if not _is_python_rng_state(state):
            raise CheckpointError(f"{where}: field 'python_rng.{rank}' is not a Python RNG state")
    for alias, name in manifest.aliases.items():
        if name not in manifest.params and name not in manifest.module_tensors:
            raise CheckpointError(f"{where}: alias '{alias}' names '{name}', which the checkpoint does not hold")
    return body


def _is_python_rng_state(state: list) -> bool:
    """``random.getstate()`` as JSON: [version, 625 integers, gauss_next (null or a number)]."""
    return (
        len(state) == 3
        and isinstance(state[0], int)
        and isinstance(state[1], list)
        and len(state[1]) == 625
        and all(isinstance(v, int) and not isinstance(v, bool) for v in state[1])
        and (state[2] is None or isinstance(state[2], (int, float)))
    )


AXIS_NAMES = {"tp": ("tensor", "tensor_parallel_size"), "ep": ("expert", "expert_parallel_size")}


def saved_split(entry: dict) -> Optional[TensorSplit]:
    """How a saved parameter was cut over tensor- or expert-parallel ranks (None: saved whole)."""
    return TensorSplit.from_record(entry["split"]) if entry.get("split") is not None else None


def _check_split(name: str, entry: ParamEntry, sizes: dict[str, int], where: str) -> None:
    """A split record is one the run could have written: its axis was in use (``sizes``: the saved degree per
    axis), it cuts over that many ranks, evenly, and a tensor of experts is cut along its expert dimension only."""
    if entry.split is None:
        return
    try:
        split = TensorSplit.from_record(entry.split)
        split.check(tuple(entry.shape), f"parameter '{name}'")
    except ValueError as err:
        raise CheckpointError(f"{where}: field 'params.{name}.split': {err}") from None
    what, key = AXIS_NAMES[split.axis]
    if sizes[split.axis] == 1:
        raise CheckpointError(
            f"{where}: field 'params.{name}.split' in a checkpoint saved without {what} parallelism ({key} 1)"
        )
    if split.parts != sizes[split.axis]:
        raise CheckpointError(
            f"{where}: field 'params.{name}.split' cuts over {split.parts} ranks, the checkpoint was saved by "
            f"{sizes[split.axis]} {what}-parallel ranks"
        )
    if split.axis == "ep" and (split.dim, split.fused, split.transposed) != (0, 1, False):
        raise CheckpointError(
            f"{where}: field 'params.{name}.split' cuts experts along dim {split.dim} (fused {split.fused}, "
            f"transposed {split.transposed}); experts are cut along dim 0 only"
        )


def _check_pieces(name: str, entry: ParamEntry, files: dict, where: str) -> None:
    numel = 1
    for dim in entry.shape:
        numel *= dim
    field = f"params.{name}.pieces"
    for i, raw in enumerate(entry.pieces):
        file, key, tensor_offset, param_offset, count = raw
        if not (isinstance(file, str) and isinstance(key, str)):
            raise CheckpointError(f"{where}: {field}[{i}]: file and key must be strings")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (tensor_offset, param_offset, count)):
            raise CheckpointError(f"{where}: {field}[{i}]: offsets and count must be integers")
        plain_name(file, "file", where)
        if file not in files:
            raise CheckpointError(f"{where}: {field}[{i}] names file {file!r}, which 'files' does not list")
        if tensor_offset < 0 or param_offset < 0 or count <= 0 or param_offset + count > numel:
            raise CheckpointError(
                f"{where}: {field}[{i}] (tensor offset {tensor_offset}, parameter offset {param_offset}, {count} "
                f"elements) lies outside parameter '{name}' of {numel} elements"
            )


def _client_references(value: Any) -> list:
    """The tensor references in saved client state (an escaped user dict is data, never a reference)."""
    if isinstance(value, dict):
        if set(value) == {TENSOR_MARK}:
            return [value[TENSOR_MARK]]
        if set(value) == {ESCAPE_MARK} and isinstance(value[ESCAPE_MARK], dict):
            value = value[ESCAPE_MARK]
        return [ref for v in value.values() for ref in _client_references(v)]
    if isinstance(value, list):
        return [ref for v in value for ref in _client_references(v)]
    return []


def _saved_layout(manifest: Manifest, where: str) -> ParallelDims:
    """The inner dimensions of the mesh that saved (tensor, sequence, expert): where each rank's pieces lie."""
    tp, ep, spans = manifest.tensor_parallel_size, manifest.expert_parallel_size, manifest.expert_tensor_ranks
    try:
        return ParallelDims(dp_shard=ep // spans, sp=manifest.sequence_parallel_size, tp=tp, ep=ep, ep_in_tp=spans)
    except ValueError as err:
        raise CheckpointError(f"{where}: field 'expert_tensor_ranks': {err}") from None


def _check_piece_ranks(name: str, entry: ParamEntry, sizes: dict[str, int], layout: ParallelDims, where: str) -> None:
    """A split parameter's pieces cover every tensor- (expert-) parallel rank's piece in rank order; each must come
    from a file of the rank whose piece it covers (its coordinate on the axis in the saving mesh,
    ``comm.ParallelDims.coordinate``: tensor parallelism innermost; the expert dimension outside the sequence and
    tensor ones, or taking in tensor ranks when AutoEP folded it with AutoTP), so pieces moved between the ranks'
    files are refused even with the checksum recomputed."""
    if entry.split is None:
        return
    axis = entry.split.get("axis", "tp")
    size = sizes[axis]
    what = AXIS_NAMES[axis][0]
    per = 1
    for dim in entry.shape:
        per *= dim
    per //= size
    for i, (file, _, _, param_offset, count) in enumerate(entry.pieces):
        writer = layout.coordinate(int(file[4:9]), axis)
        if param_offset // per != writer or (param_offset + count - 1) // per != writer:
            raise CheckpointError(
                f"{where}: params.{name}.pieces[{i}] covers {what}-parallel rank {param_offset // per}'s piece but "
                f"lies in {file}, written by {what}-parallel rank {writer}: pieces moved between ranks"
            )


def _check_disjoint(params: dict[str, ParamEntry], where: str) -> None:
    """Pieces tile each parameter exactly once, and no two pieces share elements of a saved tensor: a shifted
    offset that stays inside the tensor would otherwise read a neighbour's values. Inside one saved tensor the
    parameters lie in the manifest's order (every writer lays them out so), so offsets swapped between two
    parameters are refused even with the checksum recomputed."""
    order = {name: position for position, name in enumerate(params)}
    spans: dict[tuple[str, str], list[tuple[int, int, str, int]]] = {}
    for name, entry in params.items():
        covered = 0
        for i, (file, key, tensor_offset, param_offset, count) in sorted(
            enumerate(entry.pieces), key=lambda item: item[1][3]
        ):
            if param_offset != covered:
                raise CheckpointError(
                    f"{where}: params.{name}.pieces[{i}] starts at parameter offset {param_offset}, the pieces "
                    f"before it end at {covered} (gap or overlap)"
                )
            covered += count
            spans.setdefault((file, key), []).append((tensor_offset, tensor_offset + count, name, i))
        numel = 1
        for dim in entry.shape:
            numel *= dim
        if covered != numel:
            raise CheckpointError(f"{where}: the pieces of parameter '{name}' cover {covered} of {numel} elements")
    for (file, key), ranges in spans.items():
        ranges.sort()
        for (_, end, name, i), (start, _, other, j) in zip(ranges, ranges[1:]):
            if start < end:
                raise CheckpointError(
                    f"{where}: params.{other}.pieces[{j}] overlaps params.{name}.pieces[{i}] in tensor '{key}' "
                    f"of {file}"
                )
            if order[other] < order[name]:
                raise CheckpointError(
                    f"{where}: in tensor '{key}' of {file}, params.{other}.pieces[{j}] lies after "
                    f"params.{name}.pieces[{i}], against the manifest's order: offsets swapped between parameters"
                )


def piece_dtype(manifest: dict, name: str, key: str) -> str:
    """How the pieces of parameter ``name`` under flat key ``key`` are stored: trained flat groups (``fg<k>``) keep
    fp32 master weights and optimizer state; frozen ones (``ff<j>``) keep the parameter's own dtype."""
    return manifest["params"][name]["dtype"] if key.startswith("ff") else "float32"


def pieces_for(layout, flat_key: str, writer_files: list[str]) -> dict[str, list[Piece]]:
    """Pieces of every parameter of one flat group, given the file that holds each shard."""
    out: dict[str, list[Piece]] = {}
    for shard_rank, file in enumerate(writer_files):
        for seg in layout.segments(shard_rank):
            out.setdefault(seg.slot.name, []).append(
                Piece(file, flat_key, seg.shard_start, seg.flat_start - seg.slot.offset, seg.numel)
            )
    return out


def overlapping(pieces: list[Piece], start: int, stop: int):
    """(piece, tensor slice, destination slice) for each saved piece overlapping [start, stop) of a parameter."""
    for piece in pieces:
        lo, hi = max(start, piece.param_offset), min(stop, piece.param_offset + piece.numel)
        if lo < hi:
            src = piece.tensor_offset + (lo - piece.param_offset)
            yield piece, (src, src + hi - lo), (lo - start, hi - start)
