"""``deepspeed.elasticity``: ``compute_elastic_config`` as DeepSpeed 0.18 gave it (DeepSpeed 0.19 removed the package;
ms-swift's elastic callback still calls it), over zeroshard's elastic batch (``zeroshard.config.elasticity``)."""

from __future__ import annotations

import json
import os

from zeroshard.config import ConfigError, parse_config
from zeroshard.config.elasticity import batch_of

ELASTICITY = "elasticity"
ENABLED = "enabled"


class ElasticityError(Exception):
    """DeepSpeed's base elasticity error."""


class ElasticityConfigError(ElasticityError):
    """The ``elasticity`` block is missing, disabled or invalid."""


class ElasticityIncompatibleWorldSize(ElasticityError):
    """The world size is not one the elastic batch allows."""


def elasticity_enabled(ds_config: dict) -> bool:
    block = ds_config.get(ELASTICITY) if isinstance(ds_config, dict) else None
    return isinstance(block, dict) and bool(block.get(ENABLED, False))


def compute_elastic_config(
    ds_config: dict, target_deepspeed_version: str, world_size: int = 0, return_microbatch: bool = False
) -> tuple:
    """``(train_batch_size, valid_world_sizes)``, plus the micro-batch with ``world_size`` (or
    ``return_microbatch``): the global batch valid on the most world sizes, chosen from the block alone so that a
    restart at another world size keeps it. ``target_deepspeed_version`` is accepted as DeepSpeed's (any 0.x
    version runs this elasticity)."""
    if not isinstance(ds_config, dict):
        raise ValueError(f"Expected ds_config to be a dictionary but received a {type(ds_config).__name__}")
    if ELASTICITY not in ds_config:
        raise ElasticityConfigError(f"'{ELASTICITY}' is missing from the config; add it to run an elastic job")
    if not elasticity_enabled(ds_config):
        raise ElasticityConfigError("elasticity is disabled; set 'enabled': true to run an elastic job")
    if not isinstance(target_deepspeed_version, str):
        raise ElasticityError(f"target_deepspeed_version must be a version string, not {target_deepspeed_version!r}")
    try:
        block = parse_config({ELASTICITY: ds_config[ELASTICITY]}).elasticity
    except (ConfigError, ValueError, NotImplementedError) as err:
        raise ElasticityConfigError(str(err)) from None
    batch = batch_of(block)
    valid = list(batch.valid_world_sizes)
    if world_size == 0 and return_microbatch:
        current = os.environ.get("WORLD_SIZE", "")
        world_size = int(current) if current.isdigit() else 0
    if world_size > 0:
        if world_size not in valid:
            raise ElasticityIncompatibleWorldSize(
                f"World size ({world_size}) is not valid with the current list of valid GPU counts: {valid}"
            )
        micro = next(m for m in sorted(set(block.micro_batch_sizes), reverse=True)
                     if batch.train_batch_size // world_size % m == 0)  # fmt: skip
        return batch.train_batch_size, valid, micro
    if return_microbatch:
        raise ElasticityConfigError("return_microbatch needs the world size: pass world_size or set WORLD_SIZE")
    return batch.train_batch_size, valid


def ensure_immutable_elastic_config(runtime_elastic_config_dict: dict) -> None:
    """DeepSpeed compares the block with the scheduler's copy in ``DEEPSPEED_ELASTICITY_CONFIG``; the same here."""
    scheduler = os.environ.get("DEEPSPEED_ELASTICITY_CONFIG")
    if scheduler is not None and json.loads(scheduler) != runtime_elastic_config_dict:
        raise ElasticityConfigError(
            "the elasticity block differs from the one the scheduler launched with (DEEPSPEED_ELASTICITY_CONFIG)"
        )


def is_torch_elastic_compatible() -> bool:
    return True


__all__ = [
    "ElasticityConfigError",
    "ElasticityError",
    "ElasticityIncompatibleWorldSize",
    "compute_elastic_config",
    "elasticity_enabled",
    "ensure_immutable_elastic_config",
    "is_torch_elastic_compatible",
]
