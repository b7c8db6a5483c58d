"""What a pipeline engine accepts before it runs anything: the schedule its module and ZeRO stack allow (ZB-H1's
split backward, DualPipeV's and interleaved 1F1B's micro-batch counts and layouts) and the stage its mesh gives a
rank, which must be the one the module was built for."""

from __future__ import annotations

from .. import comm
from ..pipe import DualPipeVModule, PipelineError, PipelineModule, parallel_dims


def check_schedule(name: str, module: PipelineModule, stack, micro_batches: int, mesh: comm.Mesh) -> None:
    """A zero-bubble schedule splits each backward on autograd's graph (``zeroshard.runtime.split_backward``): a
    checkpointed region would be recomputed in both halves, and ZeRO-3's weights are gathered for one backward.
    A module of several stages per rank chooses its own schedule (``_check_stages_per_rank``)."""
    if module.stages_per_rank > 1:
        _check_stages_per_rank(name, module, micro_batches, mesh)
        return
    if name == "zb-h1" and getattr(stack, "stage3", None) is not None:
        raise NotImplementedError(
            "pipeline.schedule 'zb-h1' with zero_optimization.stage 3 is not implemented (each backward is split in "
            "two and stage 3 gathers the weights for one); use stage 0-2, or schedule '1f1b'"
        )
    if name == "zb-h1" and module.activation_checkpoint_interval > 0:
        raise NotImplementedError(
            "pipeline.schedule 'zb-h1' with activation checkpointing (activation_checkpoint_interval "
            f"{module.activation_checkpoint_interval}) is not implemented: each backward is split in two and a "
            "checkpointed region would be recomputed in both; set the interval to 0, or schedule '1f1b'"
        )


def _check_stages_per_rank(name: str, module: PipelineModule, micro_batches: int, mesh: comm.Mesh) -> None:
    """A module of several stages per rank chooses its schedule (DualPipeV, interleaved 1F1B), which needs enough
    micro-batches; sequence parallelism inside such stages is not built (tensor parallelism is: each stage's
    exchange slices what it sends as any stage's, the turn on DualPipeV's last rank passes it whole)."""
    stages, dual = mesh.pipe.size, isinstance(module, DualPipeVModule)
    kind = "a DualPipeVModule" if dual else f"a PipelineModule of stages_per_rank {module.stages_per_rank}"
    if name != "1f1b":
        raise ValueError(
            f"pipeline.schedule {name!r} with {kind}: the module chooses its schedule ("
            + ("DualPipeV, as in DeepSpeed" if dual else "interleaved 1F1B")
            + "); drop pipeline.schedule, or build a PipelineModule of one stage per rank for that schedule"
        )
    if dual and micro_batches < 2 * stages:
        raise ValueError(
            f"DualPipeV needs gradient_accumulation_steps >= 2 * {stages} (two per pipeline rank), got {micro_batches}"
        )
    if not dual and (stages < 2 or micro_batches % stages):
        raise ValueError(
            f"interleaved 1F1B (stages_per_rank {module.stages_per_rank}) needs 2 or more pipeline ranks and "
            f"gradient_accumulation_steps divisible by them: got {micro_batches} on {stages} ranks"
        )
    if mesh.sequence.size > 1:
        raise NotImplementedError(
            f"{kind} with sequence parallelism inside its stages is not implemented; use a PipelineModule of one "
            "stage per rank (1F1B) for that layout"
        )


def check_placed_as_built(module: PipelineModule, mesh: comm.Mesh) -> None:
    """The module built the layers of the stage its topology names for this rank; the mesh must run it there, with
    the topology's tensor- and sequence-parallel ranks (a module built for another world or layout holds other
    layers)."""
    built = parallel_dims(module.topology())
    if (
        built.coordinate(comm.get_rank(), "pp") != mesh.pipe.rank
        or (built.tp > 1 and built.tp != mesh.tensor.size)
        or (built.sp > 1 and built.sp != mesh.sequence.size)
    ):
        raise PipelineError(
            f"rank {comm.get_rank()}: the PipelineModule was built for stage {module.stage_id} of {module.topology()}, "
            f"but the engine's mesh ({mesh.dims}) places this rank at stage {mesh.pipe.rank}; build the module after "
            "init_distributed, with the topology of the world it runs on"
        )
