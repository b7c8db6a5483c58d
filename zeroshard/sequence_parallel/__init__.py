"""Long sequences: computing a sequence in tiles so the largest activations (an MLP's intermediates, the logits)
never exist whole (``tiled``)."""

from .tiled import TiledFusedLogitsLoss, TiledMLP, agreed_tile_count, tiled_mlp

__all__ = ["TiledFusedLogitsLoss", "TiledMLP", "agreed_tile_count", "tiled_mlp"]
