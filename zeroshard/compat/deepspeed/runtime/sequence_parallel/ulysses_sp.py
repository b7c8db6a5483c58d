"""``deepspeed.runtime.sequence_parallel.ulysses_sp``: Ulysses attention for Hugging Face models, its data loader
adapter and the tiled computations (``zeroshard.sequence_parallel``), under DeepSpeed's names and signatures."""

from zeroshard.sequence_parallel import (
    SequenceTiledCompute,
    TiledFusedLogitsLoss,
    TiledMLP,
    UlyssesSPAttentionHF,
    UlyssesSPDataLoaderAdapter,
    sequence_tiled_compute,
)

__all__ = [
    "SequenceTiledCompute",
    "TiledFusedLogitsLoss",
    "TiledMLP",
    "UlyssesSPAttentionHF",
    "UlyssesSPDataLoaderAdapter",
    "sequence_tiled_compute",
]
