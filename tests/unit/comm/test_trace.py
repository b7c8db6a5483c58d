"""The trace comparison that names the diverging rank (pure: traces in, sentence out)."""

from zeroshard.comm.trace import CollectiveTrace, TraceEntry, describe_divergence


def entries(*specs, start=1):
    return [
        TraceEntry(start + i, op, "world", (4,), "torch.float32", f"train.py:{10 + i}") for i, op in enumerate(specs)
    ]


def test_minority_rank_is_named_with_its_call_site():
    traces = {0: entries("all_reduce", "reduce_scatter"), 1: entries("all_reduce", "all_gather")}
    traces[2] = entries("all_reduce", "reduce_scatter")
    text = describe_divergence(traces, 3)
    assert text == (
        "collective #2: rank 1 called all_gather on 'world' of (4,) float32 at train.py:11 "
        "while ranks 0,2 called reduce_scatter on 'world' of (4,) float32 at train.py:11"
    )


def test_a_rank_that_issued_nothing_and_a_silent_rank():
    traces = {0: entries("all_reduce", "all_reduce"), 1: entries("all_reduce"), 2: entries("all_reduce", "all_reduce")}
    text = describe_divergence(traces, 4)
    assert text.startswith("collective #2: rank 1 issued no collective #2 (its last was all_reduce")
    assert "while ranks 0,2 called all_reduce" in text
    assert text.endswith("rank 3 did not report (exited, crashed, or stuck outside a collective)")


def test_agreeing_traces_and_ring_buffer_windows():
    traces = {0: entries("a", "b", "c", start=5), 1: entries("b", "c", start=6)}  # rank 0's buffer reaches further
    assert describe_divergence(traces, 2).startswith("the reporting ranks agree on their last 2 collective(s)")


def test_trace_round_trips_and_records_the_caller():
    trace = CollectiveTrace(size=2)
    for _ in range(3):
        trace.record("all_reduce", "world", (2, 3), "torch.float32")
    loaded = CollectiveTrace.from_json(trace.to_json())
    assert [e.seq for e in loaded] == [2, 3] and loaded[0].shape == (2, 3)
    assert loaded[0].site.startswith("tests/unit/comm/test_trace.py:")  # the code that issued it


def test_a_rank_that_exited_normally_and_where_the_others_wait():
    traces = {0: entries("all_reduce", "all_reduce", "reduce_scatter"), 1: entries("all_reduce", "all_reduce")}
    waiting = traces[0][-1]
    text = describe_divergence(traces, 2, exited={1: 2}, waiting=(0, waiting))
    assert text.startswith(
        "rank 1 exited normally after collective #2 (its script ended); rank 0 is waiting in collective #3 "
        "reduce_scatter on 'world' of (4,) float32 at train.py:12"
    ), text
    assert "did not report" not in text
