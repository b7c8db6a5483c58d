import pytest

from zeroshard.comm import DERIVED, CommLedger, ParallelDims


def test_ledger_counts_per_op_and_group():
    ledger = CommLedger()
    ledger.record("all_reduce", "world", 400, 400.0)
    ledger.record("all_reduce", "world", 400, 400.0)
    ledger.record("all_gather", "shard", 800, 400.0)
    summary = ledger.summary()
    assert summary[("all_reduce", "world")].calls == 2 and summary[("all_reduce", "world")].bytes == 800
    assert ledger.total_wire_bytes() == 1200.0
    assert "all_gather" in ledger.format()
    ledger.reset()
    assert ledger.total_wire_bytes() == 0


def test_exposed_wait_is_counted_per_op_and_up_the_contexts():
    from zeroshard.comm import CommContext

    process = CommContext()
    engine = process.child()
    engine.add_wait("all_gather", "shard", 0.25)
    engine.add_wait("all_gather", "world", 0.5)
    engine.add_wait("reduce_scatter", "shard", 0.125)
    assert engine.ledger.waited_by_op() == {"all_gather": 0.75, "reduce_scatter": 0.125}
    assert process.ledger.waited_by_op() == engine.ledger.waited_by_op()
    engine.ledger.reset()
    assert engine.ledger.waited_by_op() == {} and process.ledger.waited_by_op()["all_gather"] == 0.75


def test_child_context_counts_its_own_traffic_and_its_parents():
    from zeroshard.comm import CommContext

    process = CommContext()
    first, second = process.child(), process.child()
    first.record("all_reduce", "world", 400, 400.0, (100,), "torch.float32")
    second.record("all_gather", "shard", 800, 400.0, (200,), "torch.float32")
    second.ledger.reset()  # one engine's reset leaves the other's and the process's counts alone
    assert first.ledger.total_wire_bytes() == 400.0 and second.ledger.total_wire_bytes() == 0
    assert process.ledger.total_wire_bytes() == 800.0
    # one trace per process: forensics compares every collective a process issued, in order
    assert first.trace is second.trace is process.trace and [e.seq for e in process.trace.entries] == [1, 2]


def test_tensor_groups_are_consecutive_ranks_data_groups_strided_as_deepspeed_lays_them_out():
    dims = ParallelDims.for_world(8, tp=2, shard_group_size=2)
    assert (dims.dp_replicate, dims.dp_shard, dims.sp, dims.tp) == (2, 2, 1, 2)
    assert dims.derived("tensor") == [[0, 1], [2, 3], [4, 5], [6, 7]]  # tp_rank = rank % tp
    assert dims.derived("gradient") == [[0, 2, 4, 6], [1, 3, 5, 7]]  # dp_rank = rank // tp
    assert dims.derived("shard") == [[0, 2], [1, 3], [4, 6], [5, 7]]  # ZeRO shard rows inside each gradient group
    assert dims.derived("replica") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.derived("batch") == dims.derived("gradient") and dims.data_parallel_size == 4
    plain = ParallelDims.for_world(4)
    assert plain == ParallelDims(dp_shard=4) and plain.derived("tensor") == [[0], [1], [2], [3]]
    assert plain.derived("shard") == plain.derived("gradient") == [[0, 1, 2, 3]]
    for world, tp in ((6, 4), (4, 0), (4, True)):
        with pytest.raises(ValueError, match="tensor_parallel.autotp_size"):
            ParallelDims.for_world(world, tp=tp)
    with pytest.raises(ValueError, match="shard group size 3 must divide the world size 8"):
        ParallelDims.for_world(8, shard_group_size=3)


def test_sequence_groups_are_inside_zeros_shard_group():
    """Ulysses splits tokens, not the model: ZeRO keeps sharding over every rank (data x sequence); the batch
    arithmetic counts the data-parallel ranks only."""
    dims = ParallelDims.for_world(8, sp=4, shard_group_size=4)
    assert dims.derived("sequence") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert dims.derived("gradient") == [list(range(8))] and dims.derived("shard") == dims.derived("sequence")
    assert dims.derived("batch") == [[0, 4], [1, 5], [2, 6], [3, 7]] and dims.data_parallel_size == 2
    with pytest.raises(ValueError, match="sequence_parallel_size 3 must divide the number of ranks 4"):
        ParallelDims.for_world(4, sp=3)
    with pytest.raises(ValueError, match="must be a multiple of sequence_parallel_size 4"):
        ParallelDims.for_world(8, sp=4, shard_group_size=2)


def test_tensor_and_sequence_parallelism_are_one_mesh_shape():
    """TP innermost (consecutive ranks), SP next: the sequence groups stride by tp, and ZeRO's groups are the
    ranks of one tensor position."""
    dims = ParallelDims.for_world(8, tp=2, sp=2)
    assert (dims.dp_replicate, dims.dp_shard, dims.sp, dims.tp, dims.world_size) == (1, 2, 2, 2, 8)
    assert dims.derived("tensor") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.derived("sequence") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.derived("shard") == dims.derived("gradient") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert dims.derived("batch") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    every = [sorted(r for g in dims.derived(name) for r in g) for name in DERIVED]
    assert all(ranks == list(range(8)) for ranks in every)  # each derived name partitions the world
    with pytest.raises(ValueError, match="autotp_size 2 x sequence_parallel_size 4 must divide the number of ranks 4"):
        ParallelDims.for_world(4, tp=2, sp=4)


@pytest.mark.parametrize("field", ["dp_shard", "tp", "sp", "dp_replicate"])
@pytest.mark.parametrize("value", [0, -1, 1.5, "2", True, None])
def test_parallel_dims_refuse_sizes_that_are_not_positive_ints(field, value):
    with pytest.raises(ValueError, match=f"parallel dimension {field} must be a positive int"):
        ParallelDims(**{field: value})


def test_pipeline_stages_are_outermost_blocks_of_consecutive_ranks():
    """DeepSpeed's PipeDataParallelTopology: stage s holds ranks s*dp .. (s+1)*dp - 1; every other group lies inside
    one stage; the pipe groups run across them."""
    dims = ParallelDims.for_world(8, pp=2, tp=2)
    assert (dims.pp, dims.dp_shard, dims.tp, dims.world_size, dims.data_parallel_size) == (2, 2, 2, 8, 2)
    assert dims.derived("stage") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert dims.derived("pipe") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.derived("tensor") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.derived("batch") == dims.derived("gradient") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert [dims.coordinate(r, "pp") for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert ParallelDims.for_world(4, pp=4).derived("pipe") == [[0, 1, 2, 3]]
    every = [sorted(r for g in dims.derived(name) for r in g) for name in DERIVED]
    assert all(ranks == list(range(8)) for ranks in every)
    for bad in (3, 0, True, 1.5):
        with pytest.raises(ValueError, match="pipeline stages .* must divide the number of ranks 8"):
            ParallelDims.for_world(8, pp=bad)
    with pytest.raises(ValueError, match="unknown parallel dimension"):
        ParallelDims(dp_shard=2).groups(("dp",))


def test_expert_groups_are_consecutive_data_ranks_as_deepspeed_lays_them_out():
    """ep splits dp_shard: expert groups of ep consecutive ranks, expert-data groups ep apart; the batch and ZeRO's
    dense shard group still hold every data rank (expert ranks see different samples)."""
    dims = ParallelDims.for_world(8, ep=2)
    assert (dims.dp_shard, dims.ep, dims.edp, dims.world_size) == (8, 2, 4, 8)
    assert dims.derived("expert") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.derived("expert_shard") == dims.derived("expert_gradient") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert dims.derived("shard") == dims.derived("batch") == dims.derived("gradient") == [list(range(8))]
    assert ParallelDims.for_world(4, ep=4).derived("expert_shard") == [[0], [1], [2], [3]]
    every = [sorted(r for g in dims.derived(name) for r in g) for name in DERIVED]
    assert all(ranks == list(range(8)) for ranks in every)
    assert [dims.rank_at(5, ep=e) for e in range(2)] == [4, 5]
    assert [dims.rank_at(5, dp_shard=d) for d in range(8)] == list(range(8))
    assert dims.rank_at(6, edp=0) == 0


def test_expert_parallel_sizes_that_do_not_fit_are_refused_by_key():
    with pytest.raises(ValueError, match="expert_parallel.autoep_size 3 must divide the 4 data-parallel ranks"):
        ParallelDims.for_world(4, ep=3)
    with pytest.raises(ValueError, match="expert_parallel.autoep_size 0 must divide"):
        ParallelDims.for_world(4, ep=0)
    with pytest.raises(ValueError, match="ep_size 4 must divide"):
        ParallelDims.for_world(6, ep=4, ep_key="ep_size")  # a DeepSpeed MoE layer names its own argument
    with pytest.raises(ValueError, match="must divide the sharded data-parallel size"):
        ParallelDims(dp_shard=4, ep=3)


def test_a_groups_counterpart_of_a_rank_shares_its_coordinates_along_the_group():
    """TP=2 x DP=2: the gradient groups are {0, 2} and {1, 3}; rank 0's counterpart in {1, 3} is rank 1 (its
    tensor-parallel peer), rank 2's is 3. Rank 0 in its own group is itself; a group made alone knows no other."""
    from zeroshard.comm import Group

    dims = ParallelDims(dp_shard=2, tp=2)
    partition = tuple(map(tuple, dims.derived("gradient")))
    assert partition == ((0, 2), (1, 3))
    odd = Group("gradient", (1, 3), None, partition=partition)
    assert [odd.counterpart(r) for r in range(4)] == [1, 1, 3, 3]
    experts = ParallelDims(dp_shard=4, ep=2)  # expert groups {0, 1} {2, 3}; expert-data groups {0, 2} {1, 3}
    partition = tuple(map(tuple, experts.derived("expert_gradient")))
    assert Group("expert_gradient", (1, 3), None, partition=partition).counterpart(2) == 3
    with pytest.raises(ValueError, match="rank 0 is in no group of the gradient group's partition"):
        Group("gradient", (1, 3), None).counterpart(0)


def test_autoep_folds_the_tensor_ranks_into_expert_groups_as_deepspeed_lays_them_out():
    """AutoEP with AutoTP: every layout DeepSpeed 0.19.8's folding lays out (its own tables, written by
    ``tests/fixtures/deepspeed_autoep_folding/make.py`` from its source) has the same tensor, dense data-parallel,
    expert and expert-data groups here; the experts shard over the ranks holding the same ones."""
    import json
    import pathlib

    fixture = pathlib.Path(__file__).parents[2] / "fixtures" / "deepspeed_autoep_folding" / "tables.json"
    tables = json.loads(fixture.read_text())["tables"]
    assert len(tables) == 11
    for t in tables:
        dims = ParallelDims.for_world(t["world"], tp=t["tp"], ep=t["ep"], experts_span_tensor=True)
        got = [dims.derived(name) for name in ("tensor", "gradient", "expert", "expert_gradient", "expert_shard")]
        assert got == [t["tp_groups"], t["dense_dp_groups"], t["ep_groups"], t["edp_groups"], t["edp_groups"]], t
        assert dims.edp * dims.tp // dims.ep_in_tp == t["edp"]
        assert [dims.coordinate(r, "ep") for r in range(t["world"])] == [
            next(g.index(r) for g in t["ep_groups"] if r in g) for r in range(t["world"])
        ]
        assert all(dims.rank_at(g[0], ep=e) == r for g in t["ep_groups"] for e, r in enumerate(g))


def test_experts_a_model_declares_stay_whole_on_each_tensor_rank():
    """Expert parameters a model declares (DeepSpeed's MoE layer, tagged tensors) are computed by the client's code
    on every token a rank holds: EP=2 x TP=2 on 8 ranks keeps the tensor ranks (consecutive) holding the same
    experts, an expert group the two data ranks of one tensor position. On 2 ranks TP=2 leaves one data rank, which
    2 expert ranks cannot divide (AutoEP folds them into the tensor group instead). Sizes that would cut a tensor
    group across expert groups are refused by both keys."""
    dims = ParallelDims.for_world(8, tp=2, ep=2)
    assert (dims.dp_shard, dims.edp, dims.tp, dims.ep_in_tp) == (4, 2, 2, 1)
    assert dims.derived("tensor") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.derived("expert") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.derived("expert_shard") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    with pytest.raises(ValueError, match="autoep_size 2 must divide the 1 data-parallel ranks"):
        ParallelDims.for_world(2, tp=2, ep=2)
    # the count that works, not the one launched: EP 2 with SP 2 needs 4 ranks (it said "a multiple of 2" on 2)
    with pytest.raises(
        ValueError, match=r"\(2 ranks launched\).*launch a multiple of 4 processes \(2 data-parallel x 2"
    ):
        ParallelDims.for_world(2, sp=2, ep=2)
    with pytest.raises(ValueError, match="raise zero_hpz_partition_size / mics_shard_size"):
        ParallelDims.for_world(4, ep=4, shard_group_size=2)
    assert ParallelDims.for_world(2, tp=2, ep=2, experts_span_tensor=True).derived("expert") == [[0, 1]]
    with pytest.raises(ValueError, match="autoep_size 3 with tensor_parallel.autotp_size 2: an expert group"):
        ParallelDims.for_world(6, tp=2, ep=3, experts_span_tensor=True)
    with pytest.raises(ValueError, match="ep_in_tp=2 must divide both ep=3 and tp=2"):
        ParallelDims(dp_shard=3, tp=2, ep=3, ep_in_tp=2)


def test_experts_compose_with_sequence_parallelism_and_hybrid_sharding():
    """EP=2 x SP=2 on 8 ranks (4 data-parallel ranks, the sequence dimension innermost): an expert group is
    two data-parallel ranks of one sequence position; the experts' shard group is the sequence ranks of one expert
    rank. EP=2 inside shard groups of 4 ranks, 2 replicas: expert groups inside each shard group, and the ranks
    holding the same experts reduce over their shard group, then the replica group."""
    sequence = ParallelDims.for_world(8, sp=2, ep=2)
    assert (sequence.dp_shard, sequence.edp, sequence.sp) == (4, 2, 2)
    assert sequence.derived("expert") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert sequence.derived("expert_shard") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert sequence.derived("sequence") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    hybrid = ParallelDims.for_world(8, ep=2, shard_group_size=4)
    assert (hybrid.dp_replicate, hybrid.dp_shard, hybrid.edp) == (2, 4, 2)
    assert hybrid.derived("expert") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert hybrid.derived("expert_shard") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert hybrid.derived("replica") == [[0, 4], [1, 5], [2, 6], [3, 7]]
