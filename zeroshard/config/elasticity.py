"""DeepSpeed's ``elasticity`` block: one global batch that stays valid as the world size changes, computed as
DeepSpeed's last elasticity (0.18; 0.19 removed it) computed it, result for result and error for error (checked
against its recorded answers on a grid of inputs: ``tests/fixtures/deepspeed_elasticity``). Pure.

Version 0.1: candidate batches are each micro-batch size (and their least common multiple) scaled by the largest
highly composite number that keeps them within ``max_train_batch_size``; the candidate valid on the most world sizes
in ``[min_gpus, max_gpus]`` wins (ties: the larger batch, or the smaller without ``prefer_larger_batch``). A world
size is valid when it divides ``batch / micro`` for some micro-batch size. Version 0.2 counts whole nodes of
``num_gpus_per_node`` (data-parallel ranks per node: ``num_gpus_per_node / model_parallel_size``); a world size
outside that set gets the largest multiple of its own micro-batch instead.

Where DeepSpeed crashed (no candidate valid on any world size; ``return_microbatch`` without a world size under
0.1) this raises :class:`ElasticityConfigError` naming the cause.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Optional

from .section import ConfigError

# the 38 smallest highly composite numbers (each has more divisors than any smaller number): batch sizes up to 720K
HIGHLY_COMPOSITE = (
    1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720, 840, 1260, 1680, 2520, 5040, 7560, 10080, 15120,
    20160, 25200, 27720, 45360, 50400, 55440, 83160, 110880, 166320, 221760, 277200, 332640, 498960, 554400, 665280,
    720720,
)  # fmt: skip
LATEST_VERSION = 0.2
MINIMUM_DEEPSPEED = (0, 3, 8)


class ElasticityError(ConfigError):
    """DeepSpeed's ``ElasticityError``: the block cannot give a batch (and its base class)."""


class ElasticityConfigError(ElasticityError):
    """The ``elasticity`` block is missing, disabled or invalid."""


class ElasticityIncompatibleWorldSize(ElasticityError):
    """The world size is not one the elastic batch allows."""


@dataclass(frozen=True)
class ElasticBlock:
    """The block's fields with DeepSpeed's defaults, validated as DeepSpeed validated them."""

    max_train_batch_size: int
    micro_batch_sizes: list
    min_gpus: int = 1
    max_gpus: int = 10000
    prefer_larger_batch: bool = True
    version: float = LATEST_VERSION
    num_gpus_per_node: int = 1
    model_parallel_size: int = 1

    @classmethod
    def from_dict(cls, block: dict) -> "ElasticBlock":
        if not isinstance(block, dict):
            raise ElasticityConfigError(
                f"the 'elasticity' block must be a dict of its keys (enabled, max_train_batch_size, "
                f"micro_batch_sizes, ...), got {type(block).__name__}: {block!r:.80}"
            )
        if not block.get("enabled", False):
            raise ElasticityConfigError(
                "Elasticity is disabled, please enable it ('enabled':true) if running an elastic training job."
            )
        for key in ("max_train_batch_size", "micro_batch_sizes"):
            if key not in block:
                raise ElasticityConfigError(f"Elasticity config missing {key}")
        micro = block["micro_batch_sizes"]
        if not isinstance(micro, list):
            raise ElasticityConfigError(
                f"Elasticity expected value of micro_batch_sizes to be a list of micro batches, instead is: "
                f"{type(micro)}, containing: {micro}"
            )
        if not all(isinstance(m, int) for m in micro):
            raise ElasticityConfigError(f"Elasticity expected micro_batch_sizes to only contain a list of integers, "
                                        f"instead contains: {micro}")  # fmt: skip
        if not all(m > 0 for m in micro):
            raise ElasticityConfigError(f"Elasticity expected micro_batch_sizes to only contain positive integers, "
                                        f"instead contains: {micro}")  # fmt: skip
        if not micro:
            raise ElasticityConfigError("elasticity.micro_batch_sizes is empty: list the micro-batch sizes allowed")
        _number(block, "max_train_batch_size", integer=False)
        for key in ("min_gpus", "max_gpus", "num_gpus_per_node", "model_parallel_size"):
            _number(block, key, integer=True)
        if isinstance(block.get("version"), str):  # DeepSpeed read it with float(): "0.2" works there too
            try:
                float(block["version"])
            except ValueError:
                raise ElasticityConfigError(f"elasticity.version {block['version']!r:.40} is not a number") from None
        else:
            _number(block, "version", integer=False)
        out = cls(
            block["max_train_batch_size"],
            micro,
            block.get("min_gpus", 1),
            block.get("max_gpus", 10000),
            block.get("prefer_larger_batch", True),
            block.get("version", LATEST_VERSION),
            block.get("num_gpus_per_node", 1),
            block.get("model_parallel_size", 1),
        )
        if out.min_gpus < 1 or out.max_gpus < 1:
            raise ElasticityConfigError(
                f"Elasticity min/max gpus must be > 0, given min_gpus: {out.min_gpus}, max_gpus: {out.max_gpus}"
            )
        if out.max_gpus < out.min_gpus:
            raise ElasticityConfigError(f"Elasticity min_gpus cannot be greater than max_gpus, given min_gpus: "
                                        f"{out.min_gpus}, max_gpus: {out.max_gpus}")  # fmt: skip
        if out.model_parallel_size < 1:
            raise ElasticityConfigError(f"Model-Parallel size cannot be less than 1, given model-parallel size: "
                                        f"{out.model_parallel_size}")  # fmt: skip
        if out.num_gpus_per_node < 1:
            raise ElasticityConfigError(f"Number of GPUs per node cannot be less than 1, given number of GPUs per "
                                        f"node: {out.num_gpus_per_node}")  # fmt: skip
        if block.get("min_time", 0) < 0:
            raise ElasticityConfigError(f"Elasticity min time needs to be >= 0: given {block['min_time']}")
        return out


def _number(block: dict, key: str, integer: bool) -> None:
    """``block[key]``, when present, is a finite number (an int where ``integer``): DeepSpeed crashed on a string
    or NaN further down."""
    if key not in block:
        return
    value = block[key]
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value):
        raise ElasticityConfigError(
            f"elasticity.{key} must be {'an integer' if integer else 'a finite number'}, got {value!r:.40}"
        )


def valid_world_sizes(batch: int, micro_batch_sizes: list, min_gpus: int, max_gpus: int) -> list[int]:
    """World sizes in ``[min_gpus, max_gpus]`` that split ``batch`` into a whole number of micro-batches of one of
    the allowed sizes per rank."""
    sizes = set()
    for micro in micro_batch_sizes:
        if batch % micro == 0:
            most = batch // micro
            sizes |= {g for g in range(min_gpus, min(max_gpus, most) + 1) if most % g == 0}
    return sorted(sizes)


def _candidates(bases: list[int], limit: int) -> list[int]:
    """Each base scaled by the largest highly composite number that keeps it within ``limit`` (a base at or above
    the limit stays itself; beyond the table, its last number)."""
    out = set()
    for base in bases:
        if base >= limit:
            out.add(base)
            continue
        above = next((i for i, h in enumerate(HIGHLY_COMPOSITE) if h > limit // base), 0)
        out.add(HIGHLY_COMPOSITE[above - 1] * base)
    return sorted(out)


def _best_batch(micro: list, limit: int, min_gpus: int, max_gpus: int, prefer_larger: bool):
    """Version 0.1: (batch, its valid world sizes; None where no candidate is valid anywhere and the smallest
    micro-batch stands, as DeepSpeed returned)."""
    min_gpus = min_gpus or 1
    max_gpus = max_gpus or limit // min(micro)
    if not all(m <= limit for m in micro):
        raise ConfigError(f"All micro batches must be less than or equal to max_acceptable_batch_size: {limit}")
    best, best_valid, most = int(min(micro)), None, 0
    lcm = math.lcm(*micro)  # above the limit it is no candidate (DeepSpeed's PR 8237: 0.18 returned it, over the max)
    for batch in _candidates([*micro, *([lcm] if lcm <= limit else [])], limit):
        valid = valid_world_sizes(batch, micro, min_gpus, max_gpus)
        tie = len(valid) == most and (batch > best if prefer_larger else batch < best)
        if len(valid) > most or tie:
            best, best_valid, most = batch, valid, len(valid)
    return best, best_valid


def _nodes_batch(block: ElasticBlock, world_size: int) -> tuple[Any, list[int], Optional[int]]:
    """Version 0.2: the 0.1 search over nodes, scaled by the data-parallel ranks per node."""
    micro, per_node, parallel = block.micro_batch_sizes, block.num_gpus_per_node, block.model_parallel_size
    if per_node % parallel != 0:
        raise ElasticityError(f"In Elasticity v0.2, number of GPUs per node:{per_node} should be divisible by model "
                              f"parallel size {parallel}")  # fmt: skip
    ranks_per_node = per_node // parallel
    batch, nodes = _best_batch(
        micro,
        int(block.max_train_batch_size / ranks_per_node),
        int(block.min_gpus / per_node),
        int(block.max_gpus / per_node),
        block.prefer_larger_batch,
    )
    if nodes is None:
        raise ElasticityConfigError(_none_valid(block))
    batch, valid = int(batch) * ranks_per_node, [n * ranks_per_node for n in nodes]

    def micro_for(total) -> Optional[int]:
        chosen = None
        for m in micro:
            if total // world_size % m == 0 and (chosen is None or (block.prefer_larger_batch and chosen < m)):
                chosen = m
        return chosen

    if world_size // parallel in valid:
        return batch, valid, micro_for(batch)
    ranks = (world_size / per_node) * ranks_per_node  # this world's data-parallel ranks (DeepSpeed's float)
    fitted = [math.floor(block.max_train_batch_size / float(m * ranks)) * m * ranks for m in micro]
    total = max(fitted) if block.prefer_larger_batch else min(fitted)
    return total, [int(ranks)], micro_for(total)


def _none_valid(block: ElasticBlock) -> str:
    return (
        f"elasticity: no global batch up to max_train_batch_size {block.max_train_batch_size} splits into "
        f"micro_batch_sizes {block.micro_batch_sizes} on any world size from min_gpus {block.min_gpus} to max_gpus "
        f"{block.max_gpus} (DeepSpeed 0.18 failed here with a TypeError)"
    )


def _world_size_variable() -> int:
    """Elasticity 0.2 without a world size: the ``WORLD_SIZE`` variable's (DeepSpeed's words when it has none)."""
    variable = os.environ.get("WORLD_SIZE")
    if variable is None or not variable.isnumeric():
        raise ElasticityConfigError(
            "Elasticity V 0.2 needs WORLD_SIZE to compute valid batch size. Either give it as argument to "
            "function compute_elastic_config or set it as an environment variable. Value of WORLD_SIZE as "
            f"environment variable is {variable}"
        )
    return int(variable)


def compute_elastic_config(
    ds_config: Any, target_deepspeed_version: str, world_size: int = 0, return_microbatch: bool = False
) -> tuple:
    """DeepSpeed 0.18's ``compute_elastic_config``: ``(train_batch_size, valid_world_sizes)``, and the micro-batch
    as a third element with a ``world_size`` (or ``return_microbatch``)."""
    if not isinstance(ds_config, dict):
        raise ValueError(
            f"Expected ds_config to be a dictionary but received a {type(ds_config)}, containing: {ds_config}"
        )
    if "elasticity" not in ds_config:
        raise ElasticityConfigError(
            "'elasticity' is missing from config json, please add it if running an elastic training job."
        )
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 0:
        raise ElasticityConfigError(
            f"compute_elastic_config: world_size must be a non-negative int (0: the set of valid world sizes), got "
            f"{world_size!r:.40}"
        )
    block = ElasticBlock.from_dict(ds_config["elasticity"])
    version = float(block.version)
    if block.model_parallel_size > 1 and version != 0.2:
        raise ElasticityConfigError(f"Elasticity V{block.version} does not support model-parallel training. Given "
                                    f"model-parallel size: {block.model_parallel_size}")  # fmt: skip
    if version > LATEST_VERSION:
        raise ElasticityConfigError(f"Attempting to run elasticity version {block.version} but runtime only supports "
                                    f"up to {LATEST_VERSION}")  # fmt: skip
    _check_target_version(target_deepspeed_version)
    candidate_micro = None
    if version == 0.1:
        batch, valid = _best_batch(
            block.micro_batch_sizes,
            block.max_train_batch_size,
            block.min_gpus,
            block.max_gpus,
            block.prefer_larger_batch,
        )
        batch = int(batch)
    elif version == 0.2:
        batch, valid, candidate_micro = _nodes_batch(block, world_size or _world_size_variable())
        batch = int(batch)
    else:
        raise NotImplementedError(f"Unable to find elastic logic for version: {block.version}")
    if world_size > 0:
        if valid is None:
            raise ElasticityConfigError(_none_valid(block))
        if world_size not in valid:
            raise ElasticityIncompatibleWorldSize(
                f"World size ({world_size}) is not valid with the current list of valid GPU counts: {valid}"
            )
        return batch, valid, _largest_micro(block, batch, world_size)
    if return_microbatch:
        if version == 0.2:
            return batch, valid, candidate_micro
        raise ElasticityConfigError(
            "elasticity version 0.1 with return_microbatch needs the world size (DeepSpeed 0.18 divided by zero): "
            "pass world_size"
        )
    return batch, valid


def _largest_micro(block: ElasticBlock, batch: int, world_size: int) -> int:
    for micro in sorted(set(block.micro_batch_sizes), reverse=True):
        if batch // world_size % micro == 0:
            return micro
    raise ElasticityConfigError(
        f"Unable to find divisible micro batch size world_size={world_size}, final_batch_size={batch}, and "
        f"micro_batches={block.micro_batch_sizes}."
    )


def _check_target_version(target: Any) -> None:
    if not isinstance(target, str):
        raise ElasticityError(f"target_deepspeed_version must be a version string, not {target!r}")
    parts = []
    for piece in target.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    if not parts:
        raise ElasticityError(f"target_deepspeed_version {target!r} is not a version")
    if tuple(parts + [0] * (3 - len(parts))) < MINIMUM_DEEPSPEED:
        raise ElasticityError(
            f"Target deepspeed version of {target} is not compatible with minimum version 0.3.8 supporting elasticity."
        )


def elastic_batch(block: dict, world_size: int) -> tuple[int, list[int], int]:
    """The config's resolution: (train_batch_size, valid world sizes, micro-batch) at ``world_size``."""
    return compute_elastic_config({"elasticity": {**block, "enabled": True}}, "0.19.8", world_size=world_size)
