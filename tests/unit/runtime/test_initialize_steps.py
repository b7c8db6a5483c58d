"""``initialize``'s build steps, each alone (no process group needed)."""

import importlib

import pytest
import torch
from torch.utils.data import TensorDataset

from zeroshard import comm
from zeroshard.config import parse_config
from zeroshard.runtime.optimizer_recipe import optimizer_recipe

steps = importlib.import_module("zeroshard.runtime.initialize")  # the module, not the function it exports


def _cfg(extra=None):
    return parse_config({"train_micro_batch_size_per_gpu": 2, **(extra or {})})


def test_a_callable_scheduler_needs_an_optimizer():
    with pytest.raises(ValueError, match="lr_scheduler= is a callable .* no optimizer"):
        steps._build_scheduler(lambda optimizer: None, _cfg(), zero=None)


def test_a_scheduler_object_is_kept_and_no_block_means_none():
    scheduler = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)]), lambda s: 1)
    assert steps._build_scheduler(scheduler, _cfg(), zero=None) is scheduler
    assert steps._build_scheduler(None, _cfg(), zero=None) is None


def test_placement_follows_precision_and_offload():
    cfg = _cfg({"bf16": {"enabled": True}, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})
    placement = steps._placement(cfg)
    assert placement.policy.compute == torch.bfloat16 and placement.policy.master == torch.float32
    assert placement.offload.optimizer_device == "cpu"


def test_a_dataset_gets_the_resumable_sampler():
    from zeroshard.config import AutoContext, resolve_config
    from zeroshard.runtime.sampler import ResumableDistributedSampler

    resolution = resolve_config(_cfg(), AutoContext(world_size=1))
    world = comm.Group("world", (0,), None)
    alone = comm.Group("alone", (0,), None)
    mesh = comm.Mesh(
        comm.ParallelDims(), world, alone, alone, world, alone, world, world, alone, world, world, alone, world
    )
    from zeroshard.runtime.parallelize import ParallelPlan, PipelineTies

    pipeline = PipelineTies(groups={}, tensors={})
    for shuffle, plan in ((True, ParallelPlan({})), (False, ParallelPlan({}, pipeline))):  # DeepSpeed's deepspeed_io,
        # and its pipeline engine's (in order)
        loader = steps._build_dataloader(TensorDataset(torch.arange(10.0)), resolution, mesh, None, plan)
        assert isinstance(loader.sampler, ResumableDistributedSampler) and loader.batch_size == 2
        assert loader.sampler.shuffle is shuffle


def test_a_client_optimizer_and_a_config_block_are_refused_together():
    model = torch.nn.Linear(2, 2)
    cfg = _cfg({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    placement = steps._placement(cfg)
    with pytest.raises(ValueError, match="both a client optimizer and an 'optimizer' config block"):
        optimizer_recipe(torch.optim.AdamW(model.parameters()), model, None, cfg, placement.offload)
