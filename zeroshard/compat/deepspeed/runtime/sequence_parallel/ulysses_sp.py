"""``deepspeed.runtime.sequence_parallel.ulysses_sp``: Ulysses attention for Hugging Face models, its data loader
adapter and the tiled computations (``zeroshard.sequence_parallel``), under DeepSpeed's names and signatures."""

from __future__ import annotations

import warnings
from typing import Any, Optional

from zeroshard.sequence_parallel import (
    SequenceParallelGroups,
    SequenceTiledCompute,
    TiledFusedLogitsLoss,
    TiledMLP,
    UlyssesAttention,
    UlyssesSPDataLoaderAdapter,
    register_with_transformers,
    sequence_tiled_compute,
)


class UlyssesSPAttentionHF(UlyssesAttention):
    """DeepSpeed's class: clients call its ``register_with_transformers`` (Accelerate, the HF Trainer, ALST)."""

    @classmethod
    def register_with_transformers(
        cls,
        model_name_or_path: Any,
        core_attn_implementation: str,
        sequence_parallel_size: int,
        micro_batch_size: int,
        seq_length: Optional[int] = None,
        seq_length_is_variable: bool = True,
        disable_in_eval: bool = False,
        max_length: Optional[int] = None,
    ) -> Optional[SequenceParallelGroups]:
        """Route ``core_attn_implementation`` through Ulysses and return the mpu for ``deepspeed.initialize(mpu=)``
        (``None`` when ``sequence_parallel_size`` is 1). ``max_length`` is DeepSpeed's deprecated ``seq_length``."""
        if max_length is not None:
            warnings.warn("register_with_transformers(max_length=) is deprecated: use seq_length=", stacklevel=2)
            seq_length = seq_length if seq_length is not None else max_length
        return register_with_transformers(
            model_name_or_path,
            core_attn_implementation,
            sequence_parallel_size,
            micro_batch_size,
            seq_length=seq_length,
            seq_length_is_variable=seq_length_is_variable,
            disable_in_eval=disable_in_eval,
        )


__all__ = [
    "SequenceTiledCompute",
    "TiledFusedLogitsLoss",
    "TiledMLP",
    "UlyssesSPAttentionHF",
    "UlyssesSPDataLoaderAdapter",
    "sequence_tiled_compute",
]
