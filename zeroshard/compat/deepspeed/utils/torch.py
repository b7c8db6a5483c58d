"""``deepspeed.utils.torch``: the torch-version check DeepSpeed's code and tests gate on, and its gradient hook."""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch

Version = Union[str, float, int]


def required_torch_version(min_version: Optional[Version] = None, max_version: Optional[Version] = None) -> bool:
    """Whether the running torch is at least ``min_version`` and at most ``max_version`` (DeepSpeed's bounds)."""
    if min_version is None and max_version is None:
        raise ValueError("required_torch_version needs min_version or max_version")
    running = torch.torch_version.TorchVersion(torch.__version__.split("+")[0])
    if min_version is not None and running < str(min_version):
        return False
    return max_version is None or running <= str(max_version)


def register_grad_hook(param: torch.Tensor, hook: Callable[[torch.Tensor], Any]):
    """A hook run once the parameter's gradient is accumulated (torch's post-accumulate-grad hook)."""
    return param.register_post_accumulate_grad_hook(hook)


__all__ = ["register_grad_hook", "required_torch_version"]
