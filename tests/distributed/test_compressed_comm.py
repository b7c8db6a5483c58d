"""zeroshard.comm's compressed collectives on 4 real Gloo ranks, against exact math: every rank's result equals a
one-process simulation of all ranks' compressions in the same message format (1-bit with error feedback, int8 and
int4 without), on the world and on 2-rank subgroups; the ledger counts the bytes of the messages. Plus the named
refusal of a 1-bit optimizer with hybrid sharding (it needs 4 ranks)."""

import pytest
import torch

from zeroshard.comm.compression import INT4, INT8, ONE_BIT, compress_with_feedback
from zeroshard.testing import run_distributed
from zeroshard.testing.parity import make_model

WORLD = 4
CHUNK = 1001  # odd: blocks and payload bytes do not divide it
ROUNDS = 3
CODECS = {"1bit": (ONE_BIT, True), "int8": (INT8, False), "int4": (INT4, False)}  # codec, error feedback


def rank_data(rank: int, salt: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 * salt + rank))


def collectives_worker() -> dict:
    from zeroshard import comm

    # world: 4 ranks; shard: {0, 1} and {2, 3}
    mesh = comm.build_mesh(comm.ParallelDims.for_world(4, shard_group_size=2))
    rank, out = comm.get_rank(), {}
    for group in (mesh.world, mesh.shard):
        n, me = group.size, group.rank
        for name, (codec, feedback) in CODECS.items():
            error = torch.zeros((n - 1) * CHUNK) if feedback else None
            scattered = []
            for t in range(ROUNDS):
                data = rank_data(rank, t, n * CHUNK)
                comm.compressed_reduce_scatter(data, error, group, codec=codec)
                scattered.append(data.view(n, -1)[me].clone())
            own_error = torch.zeros(CHUNK) if feedback else None
            gathered = []
            for t in range(ROUNDS):
                data = torch.zeros(n * CHUNK)
                comm.compressed_all_gather(data, own_error, group, codec=codec, input=rank_data(rank, 10 + t, CHUNK))
                gathered.append(data)
            out[group.name, name] = {"ranks": list(group.ranks), "scattered": scattered, "gathered": gathered}
        averaged = rank_data(rank, 20, n * CHUNK - 3)  # not a multiple of the group size: padded inside
        comm.OneBitAllReduce(group)(averaged, key="x")
        out[group.name, "mean"] = averaged
    out["ledger"] = {f"{op}/{g}": (t.calls, t.bytes, t.wire_bytes) for (op, g), t in mesh.context.ledger.totals.items()}
    out["hybrid"] = _initialize_error(
        {"stage": 2, "zero_hpz_partition_size": 2}, {"type": "OneBitAdam", "params": {"freeze_step": 2}}
    )
    return out


def _initialize_error(zero: dict, optimizer: dict) -> str:
    import zeroshard

    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero, "optimizer": optimizer}
    try:
        zeroshard.initialize(model=make_model(), config=config)
    except (NotImplementedError, ValueError) as err:
        return str(err)
    return "accepted"


def message(codec, values: torch.Tensor, error) -> torch.Tensor:
    """What a rank sends for ``values`` (updating ``error`` when there is one), decompressed."""
    out = torch.empty(codec.message_nbytes(values.numel()), dtype=torch.uint8)
    if error is None:
        codec.compress(values, out)
    else:
        compress_with_feedback(values, error, out, codec)
    return codec.decompress(out, values.numel(), torch.empty(values.numel()))


def simulate_reduce_scatter(ranks: list[int], codec, feedback: bool) -> list[list[torch.Tensor]]:
    """What each group member must hold after each round, from every member's compressions done here."""
    n = len(ranks)
    errors = [torch.zeros(n - 1, CHUNK) for _ in ranks]
    results = []
    for t in range(ROUNDS):
        data = [rank_data(r, t, n * CHUNK).view(n, -1) for r in ranks]
        sent = {}
        for s in range(n):
            for row, j in enumerate(j for j in range(n) if j != s):
                sent[s, j] = message(codec, data[s][j], errors[s][row] if feedback else None)
        results.append([data[me][me] + sum(sent[s, me] for s in range(n) if s != me) for me in range(n)])
    return results


def simulate_all_gather(ranks: list[int], codec, feedback: bool) -> list[torch.Tensor]:
    errors = [torch.zeros(CHUNK) for _ in ranks]
    return [
        torch.cat(
            [message(codec, rank_data(r, 10 + t, CHUNK), errors[s] if feedback else None) for s, r in enumerate(ranks)]
        )
        for t in range(ROUNDS)
    ]


@pytest.fixture(scope="module")
def collectives():
    return run_distributed(collectives_worker, WORLD)


@pytest.mark.parametrize("codec", list(CODECS))
@pytest.mark.parametrize("group", ["world", "shard"])
def test_compressed_collectives_equal_the_simulated_compressions(collectives, group, codec):
    for rank, result in enumerate(collectives):
        mine = result[group, codec]
        ranks = mine["ranks"]
        me = ranks.index(rank)
        for t, expected in enumerate(simulate_reduce_scatter(ranks, *CODECS[codec])):
            torch.testing.assert_close(mine["scattered"][t], expected[me], rtol=0, atol=1e-5)
        for t, expected in enumerate(simulate_all_gather(ranks, *CODECS[codec])):
            torch.testing.assert_close(mine["gathered"][t], expected, rtol=0, atol=0)


@pytest.mark.parametrize("group", ["world", "shard"])
def test_the_1bit_average_is_the_same_on_every_member_and_near_the_mean(collectives, group):
    ranks = next(r[group, "1bit"]["ranks"] for r in collectives)
    members = [collectives[r][group, "mean"] for r in ranks]
    for other in members:
        torch.testing.assert_close(other, members[0], rtol=0, atol=0)
    exact = torch.stack([rank_data(r, 20, len(ranks) * CHUNK - 3) for r in ranks]).mean(0)
    assert (torch.sign(members[0]) == torch.sign(exact)).float().mean() > 0.6  # one 1-bit round keeps most signs


def test_ledger_counts_the_message_bytes(collectives):
    ledger = collectives[0]["ledger"]
    for name, (codec, _) in CODECS.items():
        size = codec.message_nbytes(CHUNK)
        calls, nbytes, wire = ledger[f"reduce_scatter_{name}/world"]
        extra = WORLD * ONE_BIT.message_nbytes(-(-(WORLD * CHUNK - 3) // WORLD)) if name == "1bit" else 0
        assert (calls, nbytes) == (ROUNDS + (name == "1bit"), ROUNDS * WORLD * size + extra)
        assert wire == nbytes * (WORLD - 1) / WORLD  # this rank sends every chunk's message but its own
        calls, nbytes, wire = ledger[f"all_gather_{name}/shard"]
        extra = 2 * ONE_BIT.message_nbytes(CHUNK) if name == "1bit" else 0
        assert (calls, nbytes, wire) == (ROUNDS + (name == "1bit"), ROUNDS * 2 * size + extra, nbytes / 2)
    # vs fp32: 1/32 (1-bit), 1/8 (int4), 1/4 (int8) plus the block scales and padding
    assert ONE_BIT.message_nbytes(CHUNK) <= CHUNK * 4 / 27
    assert INT4.message_nbytes(CHUNK) <= CHUNK * 4 / 7.5 and INT8.message_nbytes(CHUNK) <= CHUNK * 4 / 3.9


def test_onebit_adam_with_hybrid_sharding_is_refused_by_name(collectives):
    assert "OneBitAdam with hybrid sharding" in collectives[0]["hybrid"]
