import pytest

from zeroshard.comm import CommLedger, grid_layout


def test_grid_rows_are_shard_groups():
    assert grid_layout(8, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert grid_layout(4, None) == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="shard group size 3 must divide the world size 8"):
        grid_layout(8, 3)


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


def test_parallel_layout_is_deepspeeds_tensor_groups_contiguous_data_groups_strided():
    from zeroshard.comm import parallel_layout

    layout = parallel_layout(8, tp_size=2, shard_size=2)
    assert layout.tensor == [[0, 1], [2, 3], [4, 5], [6, 7]]  # tp_rank = rank % tp
    assert layout.data == [[0, 2, 4, 6], [1, 3, 5, 7]]  # dp_rank = rank // tp
    assert layout.shard == [[0, 2], [4, 6], [1, 3], [5, 7]]  # ZeRO shard rows inside each data group
    assert layout.replica == [[0, 4], [2, 6], [1, 5], [3, 7]]
    plain = parallel_layout(4)
    assert (plain.tensor, plain.data, plain.shard, plain.replica) == (
        [[0], [1], [2], [3]],
        [[0, 1, 2, 3]],
        [[0, 1, 2, 3]],
        [[0], [1], [2], [3]],
    )
    for world, tp in ((6, 4), (4, 0)):
        with pytest.raises(ValueError, match="tensor_parallel.autotp_size"):
            parallel_layout(world, tp)


def test_sequence_groups_are_consecutive_ranks_inside_the_data_group():
    """Ulysses splits tokens, not the model: ZeRO keeps sharding over every rank (data x sequence)."""
    from zeroshard.comm import parallel_layout

    layout = parallel_layout(8, sp_size=4, shard_size=4)
    assert layout.sequence == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.data == [[0, 1, 2, 3, 4, 5, 6, 7]] and layout.tensor == [[r] for r in range(8)]
    assert layout.shard == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="sequence_parallel_size 3 must divide the number of ranks 4"):
        parallel_layout(4, sp_size=3)
    with pytest.raises(ValueError, match="combining tensor and sequence parallelism is not supported"):
        parallel_layout(4, tp_size=2, sp_size=2)
