"""Tiled MLPs inside the ZeRO engine: parameter gradients arrive once per tile from nested backwards, which the
reducer adds before reducing; the same training as untiled at stages 2 and 3, and every rank agrees on the tile
count (ZeRO-3 regathers the weights per tile, so a rank running more tiles would wait forever)."""

import torch

from zeroshard.testing import run_distributed

STEPS = 2


class Tiled(torch.nn.Module):
    """An MLP run in tiles: how a user plugs ``tiled_mlp`` into a model (a module wrapping the model's own)."""

    def __init__(self, mlp: torch.nn.Module, tiles: int):
        super().__init__()
        self.mlp, self.tiles = mlp, tiles

    def forward(self, x):
        from zeroshard.sequence_parallel import tiled_mlp

        return tiled_mlp(self.mlp, x, self.tiles)


def worker() -> dict:
    import zeroshard
    from zeroshard.sequence_parallel import agreed_tile_count
    from zeroshard.testing.hf import tiny_causal_lm

    rank = zeroshard.comm.get_rank()
    g = torch.Generator().manual_seed(5)
    batches = torch.randint(0, 64, (STEPS, 2, 2, 24), generator=g)  # step, rank, batch, tokens
    out = {"tiles": agreed_tile_count(24 + 40 * rank, 16, zeroshard.comm.build_rank_grid().world)}
    for stage in (2, 3):
        for tiles in (None, 3):
            model = tiny_causal_lm("llama")
            if tiles is not None:
                for layer in model.model.layers:
                    layer.mlp = Tiled(layer.mlp, tiles)
            config = {
                "train_micro_batch_size_per_gpu": 2,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            }
            engine, *_ = zeroshard.initialize(model=model, config=config)
            losses = []
            for batch in batches[:, rank]:
                loss = engine(input_ids=batch, labels=batch).loss
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            state = engine.consolidated_state_dict(rank0_only=False)
            out[(stage, tiles)] = (losses, {k.replace(".mlp.mlp.", ".mlp."): v for k, v in state.items()})
            engine.destroy()
    return out


def test_tiled_mlps_train_like_untiled_ones_under_zero():
    from zeroshard.testing.parity import model_error

    for out in run_distributed(worker, 2):
        assert out["tiles"] == 4  # rank 1's 64 tokens need 4 tiles of 16; rank 0 runs 4 too
        for stage in (2, 3):
            losses, state = out[(stage, None)]
            tiled_losses, tiled_state = out[(stage, 3)]
            assert tiled_losses == losses  # the forward is the same computation
            assert model_error(tiled_state, state) <= 1e-6
