"""The DeepSpeed-format config a Lightning strategy hands to ``zeroshard.initialize``: built from the strategy's
arguments (or the user's config) and the Trainer's settings. Pure functions: no Lightning objects, no processes."""

from __future__ import annotations

import copy
import json
import os
from typing import Any, Optional, Union

# Lightning's precision flags -> the config block that turns the matching zeroshard precision on
_PRECISION_BLOCKS = {"16-mixed": "fp16", "16-true": "fp16", "bf16-mixed": "bf16", "bf16-true": "bf16"}
SUPPORTED_PRECISION = ("32-true", "16-mixed", "bf16-mixed")


def load_config(config: Union[None, str, os.PathLike, dict]) -> Optional[dict]:
    """A copy of the user's config (a dict or a JSON file), or None."""
    if config is None:
        return None
    if isinstance(config, (str, os.PathLike)):
        if not os.path.isfile(config):
            raise FileNotFoundError(f"zeroshard Lightning strategy: config file {config} does not exist")
        with open(config) as f:
            return json.load(f)
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict or a path to a JSON file, got {type(config).__name__}")
    return copy.deepcopy(config)


def zero_stage(config: dict) -> int:
    return config.get("zero_optimization", {}).get("stage", 0)


def default_config(
    stage: int,
    offload_optimizer: bool = False,
    offload_parameters: bool = False,
    offload_optimizer_device: str = "cpu",
    offload_params_device: str = "cpu",
    nvme_path: str = "/local_nvme",
    pin_memory: bool = False,
    **zero_kwargs: Any,
) -> dict:
    """The config the strategy's arguments describe (DeepSpeed's Lightning strategy takes the same names)."""
    zero: dict[str, Any] = {"stage": stage, **zero_kwargs}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": offload_optimizer_device, "pin_memory": pin_memory}
        if offload_optimizer_device == "nvme":
            zero["offload_optimizer"]["nvme_path"] = nvme_path
    if offload_parameters:
        zero["offload_param"] = {"device": offload_params_device, "pin_memory": pin_memory}
        if offload_params_device == "nvme":
            zero["offload_param"]["nvme_path"] = nvme_path
    return {"zero_optimization": zero}


def complete_config(
    config: dict,
    *,
    precision: str,
    accumulate_grad_batches: int,
    gradient_clip_val: Optional[float],
    gradient_clip_algorithm: Optional[str],
    micro_batch_size: Optional[int],
) -> dict:
    """Add what the Trainer decides (accumulation, clipping, precision, batch size) to the config; settings that
    would contradict the Trainer are refused, never silently overridden."""
    if precision not in SUPPORTED_PRECISION:
        raise ValueError(
            f"zeroshard Lightning strategy: precision {precision!r} is not supported; use one of "
            f"{list(SUPPORTED_PRECISION)}"
        )
    config = copy.deepcopy(config)
    if "gradient_accumulation_steps" in config and config["gradient_accumulation_steps"] != accumulate_grad_batches:
        raise ValueError(
            "the config sets gradient_accumulation_steps; set Trainer(accumulate_grad_batches=...) instead, which "
            "Lightning uses for its own loop too"
        )
    config["gradient_accumulation_steps"] = accumulate_grad_batches
    config.pop("train_batch_size", None)  # inferred from the micro batch, accumulation and world size
    config.setdefault("train_micro_batch_size_per_gpu", micro_batch_size or 1)
    if gradient_clip_val:
        if gradient_clip_algorithm not in (None, "norm"):
            raise ValueError(
                f"gradient_clip_algorithm={gradient_clip_algorithm!r}: zeroshard clips by the global norm only; "
                "use Trainer(gradient_clip_algorithm='norm')"
            )
        if config.get("gradient_clipping", gradient_clip_val) != gradient_clip_val:
            raise ValueError("both the config's gradient_clipping and Trainer(gradient_clip_val=...) are set; keep one")
        config["gradient_clipping"] = gradient_clip_val
    else:  # Lightning's default is no clipping; DeepSpeed's engine would clip at 1.0 when the config is silent
        config.setdefault("gradient_clipping", 0.0)
    block = _PRECISION_BLOCKS.get(precision)
    for other in ("fp16", "bf16", "bfloat16"):
        enabled = config.get(other, {}).get("enabled", False)
        if enabled and (block is None or other.replace("bfloat16", "bf16") != block):
            raise ValueError(
                f"the config enables '{other}' but the Trainer's precision is {precision!r}; make them agree"
            )
    if block is not None:
        config.setdefault(block, {})["enabled"] = True
    return config
