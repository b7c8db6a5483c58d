"""DeepSpeed's ``PipelineModule``: a model given as a sequence of layers, of which each rank builds only its stage's.

The forward of the whole model is the layers applied one after the other, each output the next one's input (a
tensor or a tuple of tensors); the stage a rank runs is ``layers[parts[s]:parts[s + 1]]``. Layers are registered
under their index in the whole sequence (``"3.weight"``), tied modules under ``tied_modules.<key>``, so a
parameter's name does not depend on the number of stages or the partition: checkpoints are read back by name at
another one.

The clients of DeepSpeed's pipeline engine subclass this class and reach into it: diffusion-pipe overrides
``_partition_layers``, calls ``_set_bounds`` and patches ``_count_layer_params``; it and gpt-neox read ``_topo``,
``global_rank``, ``_layer_specs``, ``parts``, ``loss_fn``; gpt-neox keeps its own layer list in ``specs`` and
constructs twice. Those names and their order of calls during construction are DeepSpeed's. Building a module here
communicates nothing (but ``partition_method="time"``, whose measured layer times the ranks average): the engine
(``zeroshard.initialize``) builds the process groups, starts the tied copies equal and places the module.
"""

from __future__ import annotations

import functools
import re
from typing import Callable, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from .. import comm
from .partition import partition_boundaries
from .profile import layer_times
from .spec import LayerSpec, TiedLayerSpec
from .topology import PipeDataParallelTopology, ProcessTopology, parallel_dims

non_reentrant_checkpoint = functools.partial(torch_checkpoint, use_reentrant=False)


class PipelineModule(nn.Module):
    """``layers``: modules, :class:`LayerSpec` / :class:`TiedLayerSpec` (built only on the stage holding them) or
    callables without parameters; ``num_stages`` or a ``topology`` (``pipe`` outermost, as
    ``PipeDataParallelTopology`` lays it out); ``loss_fn(outputs, labels)`` on the last stage;
    ``partition_method``: ``parameters`` (the default), ``uniform``, ``type:<regex>`` or ``time`` (the layers'
    forward + backward seconds on ``profile_batch``, one micro-batch ``(inputs, labels)``, balanced);
    ``activation_checkpoint_interval`` layers per checkpointed block (0: none) with ``activation_checkpoint_func``
    (torch's non-reentrant checkpoint by default), only blocks of ``checkpointable_layers`` classes when given;
    ``stages_per_rank`` (zeroshard's) k > 1: the layers cut into k stages per rank, rank r building stages r, r + p,
    ... and the engine running interleaved 1F1B (``zeroshard.pipe.interleaved``)."""

    def __init__(
        self,
        layers,
        num_stages: Optional[int] = None,
        topology: Optional[ProcessTopology] = None,
        loss_fn: Optional[Callable] = None,
        seed_layers: bool = False,
        seed_fn: Optional[Callable[[int], None]] = None,
        base_seed: int = 1234,
        partition_method: str = "parameters",
        activation_checkpoint_interval: int = 0,
        activation_checkpoint_func: Callable = non_reentrant_checkpoint,
        checkpointable_layers: Optional[list] = None,
        dynamic_shape: bool = False,
        profile_batch: Optional[tuple] = None,
        stages_per_rank: int = 1,
    ):
        super().__init__()
        if num_stages is None and topology is None:
            raise ValueError("PipelineModule needs num_stages= or topology=")
        _check_arguments(loss_fn, activation_checkpoint_interval, checkpointable_layers, stages_per_rank)
        self.micro_offset = 0
        self.loss_fn = loss_fn
        self.checkpointable_layers = checkpointable_layers
        self.seed_layers, self.seed_fn, self.base_seed = seed_layers, seed_fn, base_seed
        self.global_rank, self.world_size = comm.get_rank(), comm.get_world_size()
        self.local_rank = comm.backend.local_rank()
        self._topo = self._topology(num_stages, topology)
        self.num_stages = self._topo.get_dim("pipe")
        self.stage_id = parallel_dims(self._topo).coordinate(self.global_rank, "pp")  # the mesh's pp coordinate
        self._layer_specs = list(layers)
        _check_layers(self._layer_specs)
        _check_ties(self._layer_specs)
        if len(self._layer_specs) < self.num_stages:
            raise ValueError(
                f"PipelineModule: {len(self._layer_specs)} layers cannot fill {self.num_stages} pipeline stages (each "
                "stage needs at least one layer)"
            )
        self._num_layers = len(self._layer_specs)
        self._local_start, self._local_stop = 0, None
        self.profile_batch = profile_batch  # partition_method="time": the micro-batch (inputs, labels) it times
        self.stages_per_rank = stages_per_rank
        self._partition_layers(method=partition_method)
        self.forward_funcs: list = []
        self.fwd_map: dict = {}
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict = {}
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func
        self.dynamic_shape = dynamic_shape
        self._build()

    def _topology(self, num_stages: Optional[int], topology: Optional[ProcessTopology]) -> ProcessTopology:
        if topology is None:
            if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
                raise ValueError(f"num_stages must be a positive int, got {num_stages!r}")
            if self.world_size % num_stages:
                launched = comm.backend.env_world()[1]
                if not comm.is_initialized() and launched > 1:
                    raise ValueError(
                        f"num_stages {num_stages}: no process group yet, so this rank sees 1 rank of the {launched} "
                        "launched: call deepspeed.init_distributed() (zeroshard.comm.init_distributed()) before "
                        "building the PipelineModule, as DeepSpeed's pipeline scripts do"
                    )
                raise ValueError(
                    f"num_stages {num_stages} must divide the number of ranks {self.world_size}: launch a multiple "
                    f"of {num_stages} processes"
                )
            return PipeDataParallelTopology(num_pp=num_stages, num_dp=self.world_size // num_stages)
        if not isinstance(topology, ProcessTopology) or "pipe" not in topology.get_axis_names():
            raise TypeError(f"topology must be a ProcessTopology with a 'pipe' axis, got {topology!r}")
        if topology.world_size() != self.world_size:
            raise ValueError(f"the topology covers {topology.world_size()} ranks, the world has {self.world_size}")
        parallel_dims(topology)  # laid out as the mesh is, or refused by name
        return topology

    def _partition_layers(self, method: str = "parameters") -> None:
        """Decide ``parts`` (every stage's first layer, then the number of layers) and this stage's bounds;
        subclasses override it (diffusion-pipe's manual split) and call :meth:`_set_bounds`. With
        ``stages_per_rank`` k > 1 the layers are cut into k stages per rank (``num_stages`` becomes their count, as
        DeepSpeed's DualPipeVModule makes it) and this rank's are :meth:`_chunk_stages`, in phase order."""
        ranks = self.num_stages
        if self.stages_per_rank > 1:
            if self._num_layers < ranks * self.stages_per_rank:
                raise ValueError(
                    f"{type(self).__name__}: {self._num_layers} layers cannot fill the {ranks * self.stages_per_rank} "
                    f"stages of {ranks} pipeline ranks ({self.stages_per_rank} per rank, each needs at least one layer)"
                )
            self.num_stages = ranks * self.stages_per_rank
        if not isinstance(method, str):
            raise TypeError(f"partition_method must be a string, got {method!r}")
        counts = self._count_layer_params() if method.lower() == "parameters" else [0] * self._num_layers
        matches = [False] * self._num_layers
        if method.lower().startswith("type:"):
            try:
                pattern = re.compile(method.split(":", 1)[1], re.IGNORECASE)
            except re.error as err:
                raise ValueError(
                    f"partition_method {method!r}: the pattern after 'type:' is not a regex ({err})"
                ) from None
            matches = [bool(pattern.search(_layer_name(spec))) for spec in self._layer_specs]
        times = self._layer_times() if method.lower() == "time" else ()
        self.parts = partition_boundaries(method, self.num_stages, counts, matches, times)
        self.phase_bounds = [(self.parts[s], self.parts[s + 1]) for s in self._chunk_stages(ranks)]
        self._set_bounds(*self.phase_bounds[0])

    def _chunk_stages(self, ranks: int) -> list[int]:
        """The stages of the model this rank builds, in phase order, for ``ranks`` pipeline ranks: its own; with
        ``stages_per_rank`` k, stages ``r, r + p, ..., r + (k - 1) p`` (the loop interleaved 1F1B runs)."""
        return [phase * ranks + self.stage_id for phase in range(self.stages_per_rank)]

    def _owner(self, stage: int) -> int:
        """The pipeline rank that builds the model's stage ``stage``."""
        return stage % (self.num_stages // self.stages_per_rank)

    def _layer_times(self) -> list[float]:
        """``partition_method="time"``: each layer's forward + backward seconds on ``profile_batch``
        (``zeroshard.pipe.profile``), averaged over the ranks so that all of them split the model alike (the one
        collective of building a module)."""
        if self.profile_batch is None:
            raise ValueError(
                "partition_method='time' measures each layer on one micro-batch: pass profile_batch=(inputs, labels) "
                "as the data iterator yields them"
            )
        times = layer_times(self._layer_specs, self.profile_batch, self.loss_fn,
                            seed=self.base_seed if self.seed_layers else None)  # fmt: skip
        if comm.is_initialized() and self.world_size > 1:
            agreed = torch.tensor(times, dtype=torch.float64)
            comm.all_reduce(agreed, comm.world_group())
            times = (agreed / self.world_size).tolist()
        self.layer_seconds = times
        return times

    def _count_layer_params(self) -> list[int]:
        """Trainable parameters of each layer (a LayerSpec is built to count, one at a time, as DeepSpeed does)."""
        counts = []
        for spec in self._layer_specs:
            layer = spec.build() if isinstance(spec, LayerSpec) else spec
            params = layer.parameters() if isinstance(layer, nn.Module) else ()
            counts.append(sum(p.numel() for p in params if p.requires_grad))
        return counts

    def _set_bounds(self, start: Optional[int] = None, stop: Optional[int] = None) -> None:
        """This rank builds layers ``start .. stop - 1`` (None: from the first, to the last)."""
        self._local_start, self._local_stop = start, stop

    def _build(self) -> None:
        """Build this rank's layers: its stage's, or each of its stages' (``stages_per_rank``) in turn, their
        forward functions kept per phase (:meth:`activate_phase`)."""
        if self.stages_per_rank == 1:
            self._build_stage()
            return
        self.phase_funcs = []
        for start, stop in self.phase_bounds:
            self._set_bounds(start, stop)
            self.forward_funcs = []
            self._build_stage()
            self.phase_funcs.append(self.forward_funcs)
        self.activate_phase(0)

    def activate_phase(self, phase: int) -> None:
        """Make ``forward`` run the layers of this rank's stage of ``phase`` (0 .. stages_per_rank - 1)."""
        if isinstance(phase, bool) or not isinstance(phase, int) or not 0 <= phase < self.stages_per_rank:
            raise ValueError(f"{type(self).__name__} has phases 0 to {self.stages_per_rank - 1}, got {phase!r}")
        self.active_phase = phase
        if self.stages_per_rank > 1:  # one stage: its layers are the only ones
            self.forward_funcs = self.phase_funcs[phase]
            self._local_start, self._local_stop = self.phase_bounds[phase]

    def _build_stage(self) -> None:
        start = self._local_start or 0
        for index, spec in enumerate(self._layer_specs[start : self._local_stop], start=start):
            if self.seed_layers:
                (self.seed_fn or torch.manual_seed)(self.base_seed + index)
            if isinstance(spec, TiedLayerSpec):
                if spec.key not in self.tied_modules:
                    self.tied_modules[spec.key] = spec.build()
                    self.tied_weight_attrs[spec.key] = spec.tied_weight_attr
                module = self.tied_modules[spec.key]
                self.forward_funcs.append(
                    module if spec.forward_fn is None else functools.partial(spec.forward_fn, module)
                )
                continue
            layer = spec.build() if isinstance(spec, LayerSpec) else spec
            if isinstance(layer, nn.Module):
                self.fwd_map[str(index)] = len(self.forward_funcs)
                self.add_module(str(index), layer)
            self.forward_funcs.append(layer)

    def layer_state_files(self) -> list[tuple[int, str]]:
        """The layers DeepSpeed's engine writes a ``layer_XX-model_states.pt`` for, every stage's: each module (a
        ``LayerSpec`` or an ``nn.Module``, parameterless ones too: their file is empty), and a tied module at the
        index of its spec without ``forward_fn`` (``(index, tie key)``; ``""`` for an untied layer). Callables
        without parameters, and a tied module's uses through ``forward_fn``, have none."""
        files = []
        for index, spec in enumerate(self._layer_specs):
            if isinstance(spec, TiedLayerSpec):
                if spec.forward_fn is None:
                    files.append((index, spec.key))
            elif isinstance(spec, (LayerSpec, nn.Module)):
                files.append((index, ""))
        return files

    def tied_keys(self) -> dict[str, list[int]]:
        """Every tie key of the whole model, with the stages holding a copy (sorted: the first is the owner)."""
        stages: dict[str, set[int]] = {}
        for index, spec in enumerate(self._layer_specs):
            if isinstance(spec, TiedLayerSpec):
                stages.setdefault(spec.key, set()).add(self.stage_owner(index))
        return {key: sorted(stages[key]) for key in sorted(stages)}

    def tied_parameters(self, key: str) -> list[nn.Parameter]:
        """The tensors tie ``key`` shares (its ``tied_weight_attr`` paths in the tied module)."""
        module = self.tied_modules[key]
        return [functools.reduce(getattr, attr.split("."), module) for attr in self.tied_weight_attrs[key]]

    def forward(self, forward_input):
        self.micro_offset += 1
        interval = self.activation_checkpoint_interval
        if interval == 0:
            return self._run(0, len(self.forward_funcs), self.micro_offset)(forward_input)
        x = forward_input
        for start in range(0, len(self.forward_funcs), interval):
            stop = min(start + interval, len(self.forward_funcs))
            run = self._run(start, stop, self.micro_offset)
            inputs = x if isinstance(x, tuple) else (x,)
            x = self.activation_checkpoint_func(run, *inputs) if self._is_checkpointable(start, stop) else run(*inputs)
        return x

    def _run(self, start: int, stop: int, micro: int) -> Callable:
        # the layers are taken now: a checkpointed block's recomputation in backward runs these, whichever chunk
        # (DualPipeVModule's phase) is active by then
        layers, first = self.forward_funcs[start:stop], (self._local_start or 0) + start

        def run(*inputs):
            x = inputs[0] if len(inputs) == 1 else inputs
            for offset, layer in enumerate(layers):
                self.curr_layer = first + offset
                if self.seed_layers:
                    (self.seed_fn or torch.manual_seed)(self.base_seed * (micro + 1) + self.curr_layer)
                x = layer(x)
            return x

        return run

    def _is_checkpointable(self, start: int, stop: int) -> bool:
        funcs = self.forward_funcs[start:stop]
        if self.checkpointable_layers is not None:
            return all(type(f).__name__ in self.checkpointable_layers for f in funcs)
        return any(any(True for _ in f.parameters()) for f in funcs if isinstance(f, nn.Module))

    def set_checkpoint_interval(self, interval: int) -> None:
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
            raise ValueError(f"activation checkpoint interval must be an int >= 0, got {interval!r}")
        self.activation_checkpoint_interval = interval

    def partitions(self) -> list[int]:
        return self.parts

    def stage_owner(self, layer_idx: int) -> int:
        if not 0 <= layer_idx < self._num_layers:
            raise ValueError(f"layer {layer_idx} is outside the {self._num_layers} layers")
        stage = next(s for s in range(self.num_stages) if self.parts[s] <= layer_idx < self.parts[s + 1])
        return self._owner(stage)

    def topology(self) -> ProcessTopology:
        return self._topo

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    def get_additional_losses(self):
        """Losses beside the main one a subclass reports (DeepSpeed's hook; none here)."""
        return None


class DualPipeVModule(PipelineModule):
    """DeepSpeed 0.19's module for the DualPipeV schedule (``zeroshard.pipe.dualpipev``): the layers cut into ``2 *
    num_stages`` stages (``num_stages`` counts pipeline ranks, as for :class:`PipelineModule`, and becomes ``2 *
    num_stages`` once partitioned, as in DeepSpeed); rank ``r`` builds stage ``r`` (phase 0) and stage ``2 *
    num_stages - 1 - r`` (phase 1). Layers tied between its two stages (rank 0's first and last: the usual embedding
    and head) are one module there, whose gradients need no exchange. ``forward`` runs the active phase's layers
    (:meth:`activate_phase`); the engine activates each before running it."""

    def __init__(self, layers, *args, **kwargs):
        if kwargs.setdefault("stages_per_rank", 2) != 2:
            raise ValueError(
                f"DualPipeVModule runs 2 stages per rank, got stages_per_rank={kwargs['stages_per_rank']!r}"
            )
        super().__init__(layers, *args, **kwargs)

    def _chunk_stages(self, ranks: int) -> list[int]:
        return [self.stage_id, 2 * ranks - 1 - self.stage_id]

    def _owner(self, stage: int) -> int:
        return min(stage, self.num_stages - 1 - stage)


def _layer_name(spec) -> str:
    """A layer's class name for ``type:`` partitions (DeepSpeed's rule: the spec's class, a module's class, a
    function's name)."""
    if isinstance(spec, LayerSpec):
        return spec.typename.__name__
    if isinstance(spec, nn.Module):
        return type(spec).__name__
    return getattr(spec, "__name__", "")


def _check_arguments(loss_fn, interval, checkpointable_layers, stages_per_rank) -> None:
    if isinstance(stages_per_rank, bool) or not isinstance(stages_per_rank, int) or stages_per_rank < 1:
        raise ValueError(f"stages_per_rank must be an int >= 1, got {stages_per_rank!r}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable (outputs, labels) -> loss, got {loss_fn!r}")
    if isinstance(interval, bool) or not isinstance(interval, int):
        raise TypeError(f"activation_checkpoint_interval must be an int >= 0, got {interval!r}")
    if interval < 0:
        raise ValueError(f"activation_checkpoint_interval must be >= 0, got {interval}")
    if checkpointable_layers is not None and not isinstance(checkpointable_layers, list):
        raise TypeError(f"checkpointable_layers must be a list of class names, got {checkpointable_layers!r}")


def _check_layers(specs: list) -> None:
    """Each layer is a module, a spec or a callable without parameters (a class would be called on activations)."""
    for index, spec in enumerate(specs):
        if isinstance(spec, type):  # callable, but calling it would build a module out of the activations
            raise TypeError(
                f"PipelineModule layer {index} is the class {spec.__name__}, not a layer: pass an instance "
                f"({spec.__name__}(...)) or LayerSpec({spec.__name__}, ...)"
            )
        if not (isinstance(spec, (nn.Module, LayerSpec)) or callable(spec)):
            raise TypeError(
                f"PipelineModule layer {index} is {type(spec).__name__}: a layer is a torch.nn.Module, a "
                "LayerSpec / TiedLayerSpec or a callable without parameters"
            )


def _check_ties(specs: list) -> None:
    """Every stage builds a tied module from its own first spec of the key: the specs of one key must build the same
    class and share the same tensors, or stages would start different modules from one another's weights."""
    first: dict[str, TiedLayerSpec] = {}
    for index, spec in enumerate(specs):
        if isinstance(spec, TiedLayerSpec):
            seen = first.setdefault(spec.key, spec)
            if (seen.typename, seen.tied_weight_attr) != (spec.typename, spec.tied_weight_attr):
                raise ValueError(
                    f"PipelineModule layer {index}: TiedLayerSpec {spec.key!r} builds {spec.typename.__name__} tying "
                    f"{spec.tied_weight_attr}, an earlier one of the key {seen.typename.__name__} tying "
                    f"{seen.tied_weight_attr}; the specs of one key must agree"
                )
