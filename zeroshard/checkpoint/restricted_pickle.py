"""Reading a torch pickle someone else wrote (DeepSpeed's checkpoint files, a compat ``torch.load``) without trusting
it: torch's restricted unpickler (``weights_only=True``) rebuilds tensors, containers and plain values only, so no
code in the file runs; and what it rebuilt is measured before anyone walks it.

The measure matters because a pickle's memo lets a small file describe a huge structure: ``a = [a, a]`` nested 60
times is 8 KB on disk and 2**60 nodes to any code that walks it (converting client state to JSON, comparing
configs). The walk here visits each distinct object once and sums what a full walk would visit, so the bound costs
time linear in the file. A structure that contains itself is refused too (nothing downstream expects a cycle).
"""

from __future__ import annotations

import os
import pickle
import re
import zipfile
from typing import Any, Optional

import torch

from .safetensors_io import CheckpointError

# what a full walk of the rebuilt data may visit: containers and values, and bytes (strings and tensors, each time
# a reference reaches them); a real checkpoint's expanded size is its own size (a tied weight counts twice)
MAX_NODES = 1 << 22
SLACK_BYTES = 64 << 20  # beyond 4x the file's size


def read_restricted_pickle(path: str, holds: str, classes: list = (), map_location: Any = "cpu") -> Any:
    """A torch pickle read with the restricted unpickler (``weights_only=True``, ``classes`` allowed besides): a
    file asking for anything else is a :class:`CheckpointError` naming the class (``holds`` says what the file
    should hold), and nothing in it runs; a damaged or unreadable file, or one whose data expands past the bounds
    above through shared references, is a named error too."""
    try:
        with torch.serialization.safe_globals(list(classes)):
            data = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"GLOBAL ([\w.]+)", str(err))
        what = f"class {found.group(1)}" if found else "an object"
        raise CheckpointError(f"{path}: refused to unpickle {what}: {holds} (nothing in the file was run)") from None
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read it ({err.strerror or err})") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, RecursionError) as err:
        raise CheckpointError(f"{path}: damaged or truncated file ({type(err).__name__}: {err})") from None
    check_expanded_size(path, data, 4 * os.path.getsize(path) + SLACK_BYTES)
    return data


def check_expanded_size(path: str, data: Any, max_bytes: int) -> None:
    """Refuse ``data`` when walking it (every shared reference followed each time) would visit more than
    :data:`MAX_NODES` objects or ``max_bytes`` bytes of strings and tensors, or when it contains itself."""
    totals: dict[int, tuple[int, int]] = {}  # id -> (nodes, bytes) of the expanded walk below it
    active: set[int] = set()  # containers whose walk is under way: meeting one again is a cycle
    stack: list[tuple[Any, bool]] = [(data, False)]
    while stack:
        obj, finished = stack.pop()
        children = _children(obj)
        if children is None:
            continue
        key = id(obj)
        if finished:
            active.discard(key)
            nodes, nbytes = 1, 0
            for child in children:
                n, b = totals.get(id(child)) or (1, _leaf_bytes(child))
                nodes, nbytes = nodes + n, nbytes + b
            if nodes > MAX_NODES or nbytes > max_bytes:
                raise CheckpointError(
                    f"{path}: its data expands to more than {min(nodes, MAX_NODES)} objects / {nbytes} bytes through "
                    f"shared references (a pickle memo graph; bounds: {MAX_NODES} objects, {max_bytes} bytes): "
                    "refused, nothing was converted"
                )
            totals[key] = (nodes, nbytes)
        elif key in active:
            raise CheckpointError(f"{path}: its data contains itself (a {type(obj).__name__} inside itself): refused")
        elif key not in totals:
            active.add(key)
            stack.append((obj, True))
            stack.extend((child, False) for child in children)


def _children(obj: Any) -> Optional[list]:
    if isinstance(obj, dict):
        return [*obj.keys(), *obj.values()]
    if isinstance(obj, (list, tuple, set, frozenset)):
        return list(obj)
    if torch.is_tensor(obj) or isinstance(obj, (str, bytes, bytearray, int, float, complex, bool, type(None))):
        return None
    attributes = getattr(obj, "__dict__", None)  # an allowed class's stand-in: its attributes
    return list(attributes.values()) if isinstance(attributes, dict) else None


def _leaf_bytes(obj: Any) -> int:
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (str, bytes, bytearray)):
        return len(obj)
    return 0


__all__ = ["MAX_NODES", "check_expanded_size", "read_restricted_pickle"]
