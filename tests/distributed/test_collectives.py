"""zeroshard.comm's all-gather and reduce-scatter on real Gloo ranks: exact results (a reduce-scatter sums in rank
order, bit for bit), in place and out of place, on the world and on subgroups, with collectives of both kinds in
flight at once, and the bytes the ledger counts."""

import pytest
import torch

from zeroshard.testing import run_distributed

WORLD = 4
CHUNK = 1001  # odd: no accidental alignment


def rank_data(rank: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * rank + salt)
    return torch.randn(WORLD * CHUNK, generator=gen).to(dtype)


def collectives_worker() -> dict:
    from zeroshard import comm

    # world: 4 ranks; shard: {0, 1} and {2, 3}
    mesh = comm.build_mesh(comm.ParallelDims.for_world(4, shard_group_size=2))
    rank = comm.get_rank()
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for group in (mesh.world, mesh.shard):
            n, me = group.size, group.rank
            data = rank_data(rank, dtype)[: n * CHUNK]
            name = f"{group.name}/{dtype}"
            # reduce-scatter into a separate output, with the caller's scratch
            scratch = torch.empty(comm.reduce_scatter_scratch_numel(group, data.numel()), dtype=dtype)
            separate = torch.empty(CHUNK, dtype=dtype)
            comm.reduce_scatter(separate, data.clone(), group, scratch=scratch)
            # in place: this rank's chunk of the input receives the sum; no scratch given
            inplace = data.clone()
            comm.reduce_scatter(inplace.view(n, -1)[me], inplace, group)
            # all-gather of a separate shard, and in place (the input is this rank's chunk of the output)
            shard = rank_data(rank, dtype, salt=1)[:CHUNK]
            gathered = torch.empty(n * CHUNK, dtype=dtype)
            comm.all_gather(gathered, shard, group)
            gathered_inplace = torch.zeros(n * CHUNK, dtype=dtype)
            gathered_inplace.view(n, -1)[me].copy_(shard)
            comm.all_gather(gathered_inplace, gathered_inplace.view(n, -1)[me], group)
            out[name] = {
                "separate": separate,
                "inplace": inplace.view(n, -1)[me].clone(),
                "gathered": gathered,
                "gathered_inplace": gathered_inplace,
                "scratch_numel": scratch.numel(),
            }
    # both kinds in flight at once, issued in the same order on every rank, finished in reverse
    group = mesh.world
    pending, results = [], []
    for k in range(3):
        shard = torch.full((CHUNK + k,), float(rank + 10 * k))
        gathered = torch.empty(WORLD * (CHUNK + k))
        pending.append(comm.all_gather(gathered, shard, group, async_op=True))
        data = torch.full((WORLD * (CHUNK + k),), float(rank + 1))
        summed = torch.empty(CHUNK + k)
        pending.append(comm.reduce_scatter(summed, data, group, async_op=True))
        results.append((gathered, summed))
    for p in reversed(pending):
        p.wait()
    out["concurrent"] = results
    out["ledger"] = {f"{op}/{g}": (t.calls, t.wire_bytes) for (op, g), t in mesh.context.ledger.summary().items()}
    # a mesh with a tensor-parallel axis: the groups are DeepSpeed's, and their collectives stay inside them
    axes = comm.build_mesh(comm.ParallelDims.for_world(4, tp=2))
    sums = {}
    for group in (axes.tensor, axes.gradient, axes.shard, axes.replica):
        value = torch.tensor([float(rank)])
        comm.all_reduce(value, group)
        sums[group.name] = (group.ranks, value.item())
    out["axes"] = (sums, axes.data_parallel_size, axes.tensor.size)
    comm.destroy_mesh(axes)
    out["blocks"] = _blocks_through_autograd(mesh.world, rank)
    out["compute_only"] = _compute_only(mesh.world, rank)
    return out


def _compute_only(group, rank: int) -> dict:
    """Collectives inside ``zeroshard.testing.compute_only``: what a group of one would give, from this rank's own
    data, nothing counted; a send with no receiver returns at once (rank 0 sends, nobody receives); afterwards the
    group communicates again."""
    from zeroshard import comm
    from zeroshard.comm.collectives import all_to_all
    from zeroshard.comm.compressed import compressed_all_gather
    from zeroshard.testing import compute_only

    n, before = group.size, dict(group.context.ledger.summary())
    summed, gathered, scattered = torch.full((3,), float(rank)), torch.zeros(n * 2), torch.empty(2)
    exchanged, compressed = torch.empty(n), torch.zeros(n * 8)
    with compute_only():
        comm.all_reduce(summed, group)
        comm.all_gather(gathered, torch.tensor([rank, -rank], dtype=torch.float32), group)
        comm.reduce_scatter(scattered, torch.arange(2.0 * n) + rank, group)
        all_to_all(exchanged, torch.arange(float(n)) + 10 * rank, group)
        compressed_all_gather(compressed, None, group, input=torch.full((8,), float(rank + 1)))
        if rank == 0:
            comm.send(torch.ones(4), dst=1, group=group)
        comm.barrier(group)
    counted = dict(group.context.ledger.summary()) != before
    after = torch.tensor([float(rank)])
    comm.all_reduce(after, group)
    return {
        "summed": summed,
        "gathered": gathered,
        "scattered": scattered,
        "exchanged": exchanged,
        "compressed": compressed,
        "counted": counted,
        "after": after.item(),
    }


def _blocks_through_autograd(group, rank: int) -> tuple:
    """A 7-row tensor the ranks share, cut into blocks (2, 2, 2, 1 rows), each block scaled by its rank + 1 and the
    blocks joined back, then a weighted sum of the result differentiated: (joined, the shared tensor's gradient)."""
    from zeroshard.comm.autograd import gather_from_group, scatter_to_group

    shared = torch.arange(21.0).view(7, 3).requires_grad_()
    block = scatter_to_group(shared, group) * (rank + 1)
    joined = gather_from_group(block, group, dim=0, total=7)
    (joined * torch.linspace(-1, 1, 21).view(7, 3)).sum().backward()
    return joined.detach(), shared.grad


@pytest.fixture(scope="module")
def per_rank():
    return run_distributed(collectives_worker, WORLD)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group", ["world", "shard"])
def test_results_are_exact(per_rank, group, dtype):
    for rank, got in enumerate(per_rank):
        members = list(range(WORLD)) if group == "world" else [r for r in range(WORLD) if r // 2 == rank // 2]
        n, me = len(members), members.index(rank)
        chunks = [rank_data(r, dtype)[: n * CHUNK].view(n, -1)[me] for r in members]
        expected = chunks[0] + chunks[1]  # in rank order, one rounding per add, as the collective sums
        for chunk in chunks[2:]:
            expected = expected + chunk
        result = got[f"{group}/{dtype}"]
        assert torch.equal(result["separate"], expected)
        assert torch.equal(result["inplace"], expected)
        everyone = torch.cat([rank_data(r, dtype, salt=1)[:CHUNK] for r in members])
        assert torch.equal(result["gathered"], everyone)
        assert torch.equal(result["gathered_inplace"], everyone)
        assert result["scratch_numel"] == (n - 1) * CHUNK  # only the chunks received from the other ranks


def test_a_tensor_parallel_axis_builds_deepspeeds_groups(per_rank):
    for rank, got in enumerate(per_rank):
        sums, dp, tp = got["axes"]
        tensor = (rank - rank % 2, rank - rank % 2 + 1)  # consecutive: tp_rank = rank % 2
        data = (rank % 2, rank % 2 + 2)  # strided: dp_rank = rank // 2
        assert sums["tensor"] == (tensor, float(sum(tensor)))
        assert sums["gradient"] == sums["shard"] == (data, float(sum(data)))  # one shard row: the data group
        assert sums["replica"] == ((rank,), float(rank))
        assert (dp, tp) == (2, 2)


def test_collectives_in_flight_at_once_keep_their_messages_apart(per_rank):
    for got in per_rank:
        for k, (gathered, summed) in enumerate(got["concurrent"]):
            expected = torch.cat([torch.full((CHUNK + k,), float(r + 10 * k)) for r in range(WORLD)])
            assert torch.equal(gathered, expected)
            assert torch.equal(summed, torch.full((CHUNK + k,), float(sum(range(1, WORLD + 1)))))


def test_ledger_counts_the_bytes_each_rank_sends(per_rank):
    ledger = per_rank[0]["ledger"]
    element = {torch.float32: 4, torch.bfloat16: 2}
    # per (op, group): ring bytes (n - 1) / n of the whole tensor, which is what point-to-point sends move
    world = sum(3 / 4 * WORLD * CHUNK * e for e in element.values())
    world_concurrent = sum(3 / 4 * WORLD * (CHUNK + k) * 4 for k in range(3))
    shard = sum(1 / 2 * 2 * CHUNK * e for e in element.values())
    for op in ("all_gather", "reduce_scatter"):
        calls = {"all_gather": 2, "reduce_scatter": 2}[op]
        assert ledger[f"{op}/world"] == (2 * calls + 3, pytest.approx(calls * world + world_concurrent))
        assert ledger[f"{op}/shard"] == (2 * calls, pytest.approx(calls * shard))


def test_rows_cut_into_uneven_blocks_and_joined_back_differentiate_like_one_process(per_rank):
    """``scatter_to_group`` / ``gather_from_group`` along rows (an expert group spanning tensor ranks routes
    ``T / tp`` rows each): 7 rows over 4 ranks as ``torch.tensor_split`` cuts them; the joined tensor and the
    shared tensor's gradient equal one process scaling each block by its rank + 1."""
    shared = torch.arange(21.0).view(7, 3).requires_grad_()
    scale = torch.cat([torch.full((len(b), 1), r + 1.0) for r, b in enumerate(torch.arange(7).tensor_split(WORLD))])
    expected = shared * scale
    (expected * torch.linspace(-1, 1, 21).view(7, 3)).sum().backward()
    for joined, grad in (got["blocks"] for got in per_rank):
        assert torch.equal(joined, expected.detach())
        assert torch.equal(grad, shared.grad)


def test_compute_only_keeps_every_collective_on_its_rank_and_counts_nothing(per_rank):
    """The compute-only limit's seam: each collective gives what a group of one would give, from the rank's own data
    (an all-gather repeats its shard, a reduce-scatter keeps its chunk, an all-reduce its values), nothing reaches
    the ledger, a send needs no receiver; the same group then sums for real."""
    for rank, got in enumerate(per_rank):
        result = got["compute_only"]
        assert torch.equal(result["summed"], torch.full((3,), float(rank)))
        assert torch.equal(result["gathered"], torch.tensor([rank, -rank] * WORLD, dtype=torch.float32))
        assert torch.equal(result["scattered"], torch.arange(2.0 * WORLD)[2 * rank : 2 * rank + 2] + rank)
        assert torch.equal(result["exchanged"], torch.arange(float(WORLD)) + 10 * rank)
        assert torch.equal(result["compressed"], torch.full((8 * WORLD,), float(rank + 1)))
        assert not result["counted"]
        assert result["after"] == sum(range(WORLD))
