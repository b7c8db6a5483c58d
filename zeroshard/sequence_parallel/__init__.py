"""Long sequences: computing a sequence in tiles so the largest activations never exist whole (``tiled``)."""

from .tiled import TiledMLP, agreed_tile_count, tiled_mlp

__all__ = ["TiledMLP", "agreed_tile_count", "tiled_mlp"]
