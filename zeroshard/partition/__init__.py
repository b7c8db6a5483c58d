"""Pure partitioning math (no process groups, no allocation)."""

from .layout import FlatLayout, Segment, Slot, assign_buckets, flat_layout, round_up
from .tensor_split import TensorSplit, linear_splits

__all__ = ["FlatLayout", "Segment", "Slot", "assign_buckets", "flat_layout", "round_up", "TensorSplit", "linear_splits"]
