"""``deepspeed.elasticity``: ``compute_elastic_config`` as DeepSpeed 0.18 gave it (DeepSpeed 0.19 removed the package;
ms-swift's elastic callback still calls it), served by zeroshard's elastic batch (``zeroshard.config.elasticity``)."""

from __future__ import annotations

import json
import os

from zeroshard.config.elasticity import (
    ElasticityConfigError,
    ElasticityError,
    ElasticityIncompatibleWorldSize,
    compute_elastic_config,
)

ELASTICITY = "elasticity"
ENABLED = "enabled"
ENABLED_DEFAULT = False


def elasticity_enabled(ds_config: dict) -> bool:
    if ELASTICITY not in ds_config:
        return False
    return ds_config[ELASTICITY].get(ENABLED, ENABLED_DEFAULT)


def ensure_immutable_elastic_config(runtime_elastic_config_dict: dict) -> None:
    """DeepSpeed compares the block with the scheduler's copy in ``DEEPSPEED_ELASTICITY_CONFIG``; the same here."""
    scheduler = os.environ.get("DEEPSPEED_ELASTICITY_CONFIG")
    if scheduler is None:
        return
    theirs, ours = json.loads(scheduler), runtime_elastic_config_dict
    for key in ("max_train_batch_size", "micro_batch_sizes", "version"):
        if theirs.get(key) != ours.get(key):
            raise ElasticityConfigError(
                f"Elastic config '{key}={theirs.get(key)}' seen by resource scheduler does not match config passed "
                f"to runtime {key}={ours.get(key)}"
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
