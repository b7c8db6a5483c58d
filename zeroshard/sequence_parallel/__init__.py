"""Long sequences: Ulysses sequence parallelism for Hugging Face attention (``ulysses``: the ranks of a group each
hold a piece of every sample's tokens, all-to-all around attention), feeding it (``data``), the loss of a sample
spread over ranks (``loss``), and computing a sequence in tiles so the largest activations (an MLP's
intermediates, the logits) never exist whole (``tiled``)."""

from .data import UlyssesSPDataLoaderAdapter, shift_labels
from .loss import token_weighted_loss
from .tiled import (
    SequenceTiledCompute,
    TiledFusedLogitsLoss,
    TiledMLP,
    agreed_tile_count,
    sequence_tiled_compute,
    tiled_mlp,
)
from .ulysses import (
    HeadLayout,
    SequenceParallelGroups,
    UlyssesAttention,
    UlyssesSPAttentionHF,
    attention_all_to_all_bytes,
    register_with_transformers,
    sequence_parallel_groups,
)

__all__ = [
    "HeadLayout",
    "SequenceParallelGroups",
    "SequenceTiledCompute",
    "TiledFusedLogitsLoss",
    "TiledMLP",
    "UlyssesAttention",
    "UlyssesSPAttentionHF",
    "UlyssesSPDataLoaderAdapter",
    "agreed_tile_count",
    "attention_all_to_all_bytes",
    "register_with_transformers",
    "sequence_parallel_groups",
    "sequence_tiled_compute",
    "shift_labels",
    "tiled_mlp",
    "token_weighted_loss",
]
