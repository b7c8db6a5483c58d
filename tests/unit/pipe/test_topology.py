"""DeepSpeed's process topologies: every rank's coordinates, the groups along each axis, ``filter_match`` and the
checkpoint names equal what DeepSpeed 0.19.8 answers (``tests/fixtures/deepspeed_pipe``); bad input is a named
error."""

import json
import pathlib

import pytest

from zeroshard.pipe import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology

EXPECTED = json.loads((pathlib.Path(__file__).parents[2] / "fixtures" / "deepspeed_pipe" / "expected.json").read_text())
KINDS = {"pipe_data": PipeDataParallelTopology, "pipe_model_data": PipeModelDataParallelTopology}


@pytest.mark.parametrize("record", EXPECTED["topologies"], ids=lambda r: f"{r['kind']}{r['sizes']}")
def test_topologies_number_ranks_as_deepspeed_does(record):
    topo = KINDS[record["kind"]](*record["sizes"])
    ranks = range(topo.world_size())
    assert [list(topo.get_coord(r)) for r in ranks] == record["coords"]
    assert {axis: topo.get_axis_comm_lists(axis) for axis in topo.get_axis_names()} == record["comm_lists"]
    assert topo.filter_match(pipe=0) == record["filter_pipe0"]
    assert topo.filter_match(data=min(1, topo.get_dim("data") - 1)) == record["filter_data1"]
    assert [topo.get_rank_repr(r) for r in ranks] == record["repr"]
    assert [topo.get_rank_repr(r, omit_axes=[]) for r in ranks] == record["repr_all"]
    assert all(topo.get_rank(**topo.get_coord(r)._asdict()) == r for r in ranks)


def test_gpt_neox_reads_coordinates_by_axis_name():
    """gpt-neox: ``topo.get_coord(rank).pipe``, ``get_dim("model")``, an axis the topology lacks is size 0 and has
    no groups."""
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    coord = topo.get_coord(6)
    assert (coord.pipe, coord.data, coord.model) == (1, 1, 0)
    assert (topo.get_dim("model"), topo.get_dim("sequence")) == (2, 0)
    assert topo.get_axis_comm_lists("sequence") == []
    assert topo.get_axis_list("pipe", 1) == [4, 5, 6, 7]


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: ProcessTopology(["pipe", "pipe"], [2, 2]), "distinct axis names"),
        (lambda: ProcessTopology(["pipe"], [2, 2]), "distinct axis names"),
        (lambda: ProcessTopology(["pipe; rm -rf /"], [2]), "identifiers"),
        (lambda: ProcessTopology(["pipe"], [0]), "positive ints"),
        (lambda: ProcessTopology(["pipe"], [True]), "positive ints"),
        (lambda: ProcessTopology(["pipe"], [2.0]), "positive ints"),
        (lambda: PipeDataParallelTopology(2, 2).get_rank(pipe=0), "every axis"),
        (lambda: PipeDataParallelTopology(2, 2).get_rank(pipe=0, data=2), "outside"),
        (lambda: PipeDataParallelTopology(2, 2).get_rank(pipe=-1, data=0), "outside"),
        (lambda: PipeDataParallelTopology(2, 2).get_coord(4), "not found"),
        (lambda: PipeDataParallelTopology(2, 2).get_coord(float("nan")), "not found"),
        (lambda: PipeDataParallelTopology(2, 2).filter_match(model=0), "unknown axes"),
    ],
)
def test_bad_topology_input_is_a_named_error(build, message):
    with pytest.raises(ValueError, match=message):
        build()


@pytest.mark.parametrize("record", EXPECTED["topologies"], ids=lambda r: f"{r['kind']}{r['sizes']}")
def test_a_pipeline_topology_is_a_view_of_the_mesh(record):
    """DeepSpeed's numbering on every fixture topology is the mesh's: pipe, data and model coordinates are the mesh's
    pp, dp_shard and tp ones, the groups along each axis the mesh's groups, and the view back is the same topology."""
    from zeroshard.comm import ParallelDims
    from zeroshard.pipe import parallel_dims, pipeline_topology

    topo = KINDS[record["kind"]](*record["sizes"])
    dims = parallel_dims(topo)
    assert isinstance(dims, ParallelDims) and dims.world_size == topo.world_size()
    axes = {"pipe": "pp", "data": "dp_shard", "model": "tp"}
    for rank in range(topo.world_size()):
        coord = topo.get_coord(rank)
        assert all(getattr(coord, axis) == dims.coordinate(rank, axes[axis]) for axis in topo.get_axis_names())
    for axis in topo.get_axis_names():
        assert topo.get_axis_comm_lists(axis) == dims.groups((axes[axis],))
    view = pipeline_topology(dims, model_axis="model" in topo.get_axis_names())
    assert view.get_axis_names() == topo.get_axis_names()
    assert [view.get_dim(a) for a in view.get_axis_names()] == [topo.get_dim(a) for a in topo.get_axis_names()]
    assert [list(view.get_coord(r)) for r in range(topo.world_size())] == record["coords"]


@pytest.mark.parametrize(
    "topology, message",
    [
        (ProcessTopology(["data", "pipe"], [2, 2]), "pipeline axis must be outermost"),
        (ProcessTopology(["pipe", "model", "data"], [2, 2, 2]), "model axis innermost"),
        (ProcessTopology(["pipe", "expert"], [2, 2]), "has no place on the mesh"),
        (ProcessTopology(["pipe", "sequence", "data"], [2, 2, 2]), "elsewhere on the mesh"),
        (ProcessTopology(["data", "model"], [2, 2]), "has a 'pipe' axis"),
    ],
)
def test_a_topology_the_mesh_cannot_be_is_refused_by_name(topology, message):
    from zeroshard.pipe import parallel_dims

    with pytest.raises(ValueError, match=message):
        parallel_dims(topology)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_mesh_with_sequence_parallelism_has_a_sequence_axis_between_data_and_model(tp):
    """DeepSpeed's topologies have no sequence axis: the view of a mesh with one is a ``ProcessTopology`` whose
    ``sequence`` axis sits where the mesh orders ``sp``, each rank at its mesh coordinates, and reads back as it."""
    from zeroshard.comm import ParallelDims
    from zeroshard.pipe import parallel_dims, pipeline_topology

    dims = ParallelDims(pp=2, dp_shard=2, sp=2, tp=tp)
    view = pipeline_topology(dims)
    assert view.get_axis_names() == ["pipe", "data", "sequence", "model"][: 3 + (tp > 1)]
    assert parallel_dims(view) == dims
    for rank in range(dims.world_size):
        coord = view.get_coord(rank)
        on_mesh = tuple(dims.coordinate(rank, d) for d in ("pp", "dp_shard", "sp"))
        assert (coord.pipe, coord.data, coord.sequence) == on_mesh
