"""``deepspeed.runtime.sequence_parallel.ulysses_sp``: ``TiledMLP`` (``zeroshard.sequence_parallel``), with
DeepSpeed's ``TiledMLP.apply(fn, self, x, shards, compute_params)``. Ulysses attention, its data loader adapter and
the tiled logits loss are not here yet (issue 30)."""

from zeroshard.sequence_parallel import TiledMLP

__all__ = ["TiledMLP"]
