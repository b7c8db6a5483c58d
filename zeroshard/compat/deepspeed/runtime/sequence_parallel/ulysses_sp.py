"""``deepspeed.runtime.sequence_parallel.ulysses_sp``: ``TiledMLP`` and ``TiledFusedLogitsLoss``
(``zeroshard.sequence_parallel``) with DeepSpeed's ``apply`` signatures. Ulysses attention and its data loader
adapter are not here yet (issue 30)."""

from zeroshard.sequence_parallel import TiledFusedLogitsLoss, TiledMLP

__all__ = ["TiledFusedLogitsLoss", "TiledMLP"]
