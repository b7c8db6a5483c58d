"""Which rank wrote each of DeepSpeed's ``zero_pp_rank_*`` files: their own records must say the rank their name says,
so swapped or copied rank files are refused by name instead of importing another rank's weights and moments in the
wrong places (:mod:`.deepspeed_import` calls these after reading every file, before unpacking anything).

- Stages 1-2: each file's ``param_slice_mappings`` (where each parameter lies in its partition) and
  ``partition_count`` against the layout the model states give.
- Stage 3: every rank holds pieces of the same sizes, so the shapes cannot tell; two identical files are a copy, and
  the last rank's padding (where a parameter's size is not a multiple of the world size) holds zero optimizer state,
  which a swapped file's real values do not.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .safetensors_io import CheckpointError


def check_partitions(path: str, groups: list, inner: list, world: int) -> None:
    """Stages 1-2: each rank file's ``param_slice_mappings`` (where each parameter lies in its partition) must be
    the ones of the rank its name says, so swapped or copied ``zero_pp_rank_*`` files are refused, not imported with
    another rank's weights and moments in the wrong places."""
    for rank, data in enumerate(inner):
        count = data.get("partition_count")
        counts = count if isinstance(count, (list, tuple)) else [count]
        if any(c is not None and int(c) != world for c in counts):
            raise CheckpointError(
                f"{path}: rank {rank}'s optimizer file says partition_count {count}, the model states dp_world_size "
                f"{world}: files of different runs"
            )
    for g, params in enumerate(groups):
        sizes = [o["single_partition_of_fp32_groups"][g].numel() for o in inner]
        partition = max(sizes)
        every_group = inner[0].get("param_alignment_paddings") or []
        paddings = every_group[g] if g < len(every_group) else []
        ranges, offset = [], 0
        for i, (name, shape) in enumerate(params):
            numel = math.prod(shape)
            ranges.append((name, offset, numel))
            offset += numel + (int(paddings[i]) if i < len(paddings) else 0)
        for rank, data in enumerate(inner):
            mappings = data.get("param_slice_mappings")
            if not isinstance(mappings, (list, tuple)) or g >= len(mappings):
                continue  # DeepSpeed before 0.10 wrote none: nothing to check against
            found = {
                str(n): (int(getattr(a, "start", -1)), int(getattr(a, "numel", -1))) for n, a in mappings[g].items()
            }
            if found != _expected_fragments(ranges, rank, partition):
                holder = next((r for r in range(world) if _expected_fragments(ranges, r, partition) == found), None)
                said = f"rank {holder}'s partition" if holder is not None else "a partition of no rank of this layout"
                raise CheckpointError(
                    f"{path}: zero_pp_rank_{rank}_mp_rank_00_optim_states.pt holds {said} (its param_slice_mappings of "
                    f"parameter group {g}): the rank files are swapped, copied or from another run; nothing imported"
                )


def _expected_fragments(ranges: list, rank: int, partition: int) -> dict[str, tuple[int, int]]:
    low, high = rank * partition, (rank + 1) * partition
    return {
        name: (max(offset, low) - low, min(offset + numel, high) - max(offset, low))
        for name, offset, numel in ranges
        if offset < high and offset + numel > low
    }


def check_stage3_pieces(path: str, groups: list, inner: list, base: list, world: int, rule: Optional[str]) -> None:
    """Stage 3 files hold every parameter's piece at the same sizes on every rank, so their shapes cannot tell the
    ranks apart. What can: no two ranks hold the same values (a copied file); and where a parameter's size is not a
    multiple of the world size, the last rank's piece ends in padding whose gradient is zero, so its ``exp_avg_sq``
    is zero there, which a swapped file's real values are not (checked where weight decay cannot reach the
    padding's moments: AdamW, or no weight decay; the padded master values themselves are uninitialised memory)."""
    flats = [[t.float().reshape(-1) for t in o["fp32_flat_groups"]] for o in inner]
    for rank, data in enumerate(inner):
        if data.get("partition_count") is not None and int(data["partition_count"]) != world:
            raise CheckpointError(
                f"{path}: rank {rank}'s optimizer file says partition_count {data['partition_count']}, the model "
                f"states dp_world_size {world}: files of different runs"
            )
    for a in range(world):
        for b in range(a + 1, world):
            if all(torch.equal(x, y) for x, y in zip(flats[a], flats[b])):
                raise CheckpointError(
                    f"{path}: zero_pp_rank_{a} and zero_pp_rank_{b}'s optimizer files hold the same values: one is a "
                    "copy of the other; nothing imported"
                )
    last = world - 1
    for g, params in enumerate(groups):
        group = base[last]["param_groups"][g] if g < len(base[last]["param_groups"]) else {}
        if not (rule == "AdamW" or group.get("weight_decay", 0) == 0):
            continue
        moment = base[last]["state"].get(g, {}).get("exp_avg_sq")
        if not isinstance(moment, torch.Tensor):
            continue
        moment, offset = moment.reshape(-1), 0
        for name, shape in params:
            numel = math.prod(shape)
            part = math.ceil(numel / world)
            padding = part * world - numel
            if padding and offset + part <= moment.numel() and moment[offset + part - padding : offset + part].any():
                raise CheckpointError(
                    f"{path}: zero_pp_rank_{last}_mp_rank_00_optim_states.pt holds optimizer state where the last "
                    f"rank's padding of {name} lies: it was written by another rank (swapped or copied rank files); "
                    "nothing imported"
                )
            offset += part


__all__ = ["check_partitions", "check_stage3_pieces"]
