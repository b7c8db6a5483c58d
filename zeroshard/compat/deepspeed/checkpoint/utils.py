"""``deepspeed.checkpoint.utils``."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map

_CPU = torch.device("cpu")


def clone_tensors_for_torch_save(item, device: torch.device = _CPU):
    """Copies of every tensor in a nested structure, detached and compact (a view of a big flat buffer would
    otherwise save the whole buffer), on ``device``."""
    return tree_map(lambda t: t.detach().to(device, copy=True) if torch.is_tensor(t) else t, item)


__all__ = ["clone_tensors_for_torch_save"]
