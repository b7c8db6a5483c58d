"""PipelineModule in one process (one stage holds every layer): what it builds, how it names parameters, its
forward and activation checkpointing, DeepSpeed's hooks its clients override, and the arguments it refuses."""

import pytest
import torch
from torch import nn

from zeroshard.config import parse_config
from zeroshard.pipe import LayerSpec, PipeDataParallelTopology, PipelineModule, ProcessTopology, TiedLayerSpec


class Embed(nn.Module):
    def __init__(self, vocab=11, dim=4):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, dim))

    def forward(self, ids):
        return self.weight[ids]


def head(embed, x):
    return x @ embed.weight.t()


def layers():
    return [
        TiedLayerSpec("embed", Embed),
        LayerSpec(nn.Linear, 4, 4),
        lambda x: torch.tanh(x),
        nn.Linear(4, 4),
        TiedLayerSpec("embed", Embed, forward_fn=head),
    ]


def test_one_stage_builds_every_layer_under_its_index_and_ties_one_module():
    module = PipelineModule(layers(), num_stages=1, partition_method="uniform")
    assert module.parts == [0, 5] and (module.num_stages, module.stage_id) == (1, 0)
    assert sorted(n for n, _ in module.named_parameters()) == [
        "1.bias",
        "1.weight",
        "3.bias",
        "3.weight",
        "tied_modules.embed.weight",
    ]
    assert module.tied_keys() == {"embed": [0]}
    assert module.tied_parameters("embed") == [module.tied_modules["embed"].weight]
    ids = torch.tensor([[1, 2, 3]])
    x = module.tied_modules["embed"](ids)
    expected = head(module.tied_modules["embed"], module._modules["3"](torch.tanh(module._modules["1"](x))))
    assert torch.equal(module(ids), expected)


def test_seeded_layers_do_not_depend_on_what_was_built_before():
    a = PipelineModule(layers(), num_stages=1, seed_layers=True, base_seed=7)
    torch.manual_seed(123)
    b = PipelineModule(layers(), num_stages=1, seed_layers=True, base_seed=7)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q) or name.startswith("3."), name  # layer 3 came built (the caller's RNG)


def test_activation_checkpointing_is_bit_identical_and_recomputes():
    torch.manual_seed(0)
    plain = PipelineModule(layers(), num_stages=1)
    checked = PipelineModule(layers(), num_stages=1, activation_checkpoint_interval=2)
    checked.load_state_dict(plain.state_dict())
    ids = torch.tensor([[1, 2, 3, 4]])
    for module in (plain, checked):
        module(ids).square().sum().backward()
    for (name, p), (_, q) in zip(plain.named_parameters(), checked.named_parameters()):
        assert torch.equal(p.grad, q.grad), name
    checked.set_checkpoint_interval(0)
    assert checked.activation_checkpoint_interval == 0


def test_a_subclass_partitions_by_hand_through_deepspeeds_hooks():
    """diffusion-pipe's shape: an attribute set before the base class's construction, ``_partition_layers``
    overridden, ``_set_bounds`` called, ``_count_layer_params`` patchable."""

    class Manual(PipelineModule):
        def __init__(self, *args, split=None, **kwargs):
            self.split = split
            super().__init__(*args, **kwargs)

        def _partition_layers(self, method="uniform"):
            if method == "manual":
                self.parts = [0, len(self._layer_specs)]
                self._set_bounds(start=self.split, stop=None)
            else:
                super()._partition_layers(method)

    module = Manual(layers(), num_stages=1, partition_method="manual", split=3)
    assert sorted(n for n, _ in module.named_parameters()) == ["3.bias", "3.weight", "tied_modules.embed.weight"]
    counted = PipelineModule(layers(), num_stages=1)
    assert counted._count_layer_params() == [44, 20, 0, 20, 44]


def test_type_partitions_match_class_names():
    module = PipelineModule(layers(), num_stages=1, partition_method="type:linear")
    assert module.parts == [0, 5]
    with pytest.raises(ValueError, match="matches no layer's class name"):
        PipelineModule(layers(), num_stages=1, partition_method="type:conv")


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({}, ValueError, "needs num_stages= or topology="),
        ({"num_stages": 0}, ValueError, "num_stages must be a positive int"),
        ({"num_stages": 2}, ValueError, "num_stages 2 must divide the number of ranks 1"),
        ({"num_stages": True}, ValueError, "num_stages must be a positive int"),
        ({"topology": "pipe"}, TypeError, "topology must be a ProcessTopology"),
        ({"topology": ProcessTopology(["data"], [1])}, TypeError, "with a 'pipe' axis"),
        ({"topology": PipeDataParallelTopology(num_pp=1, num_dp=2)}, ValueError, "covers 2 ranks"),
        ({"num_stages": 1, "loss_fn": 3}, TypeError, "loss_fn must be callable"),
        ({"num_stages": 1, "checkpointable_layers": "Linear"}, TypeError, "checkpointable_layers must be a list"),
        ({"num_stages": 1, "activation_checkpoint_interval": -1}, ValueError, "activation_checkpoint_interval"),
        ({"num_stages": 1, "activation_checkpoint_interval": 1.5}, TypeError, "activation_checkpoint_interval"),
        ({"num_stages": 1, "partition_method": "profile"}, NotImplementedError, "'profile' is not implemented"),
        ({"num_stages": 1, "partition_method": 3}, TypeError, "partition_method must be a string"),
    ],
)
def test_bad_arguments_are_named_errors(kwargs, error, message):
    with pytest.raises(error, match=message):
        PipelineModule(layers(), **kwargs)


def test_a_module_built_before_the_process_group_says_so(monkeypatch):
    """docs/tutorials/pipeline.md once built the module first: on 2 launched ranks it said '... number of ranks 1'."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match=r"call deepspeed.init_distributed\(\) .* before building the PipelineModule"):
        PipelineModule(layers(), num_stages=2)


def test_layers_that_are_not_layers_and_ties_that_disagree_are_refused():
    with pytest.raises(TypeError, match="layer 1 is str"):
        PipelineModule([nn.Linear(2, 2), "rm -rf /"], num_stages=1)
    with pytest.raises(TypeError, match=r"layer 1 is the class Identity, not a layer: pass an instance \(Identity"):
        PipelineModule([nn.Linear(2, 2), nn.Identity, nn.Linear(2, 2)], num_stages=1)
    for pattern in ("type:(", "type:[a-", "type:*"):
        with pytest.raises(ValueError, match="the pattern after 'type:' is not a regex"):
            PipelineModule(layers(), num_stages=1, partition_method=pattern)
    with pytest.raises(ValueError, match="TiedLayerSpec 'embed' builds Embed tying \\['other'\\]"):
        PipelineModule([TiedLayerSpec("embed", Embed), TiedLayerSpec("embed", Embed, tied_weight_attr="other")], 1)
    with pytest.raises(ValueError, match="0 layers cannot fill 1 pipeline stages"):
        PipelineModule([], num_stages=1)


def test_the_pipeline_config_block():
    block = parse_config({"train_batch_size": 1, "pipeline": {"stages": "auto", "use_reentrant": False}}).pipeline
    assert block.stages is None and block.use_reentrant is False and block.pipe_partitioned
    assert parse_config({"train_batch_size": 1, "pipeline": {"stages": 4}}).pipeline.stages == 4
    for bad in ({"stages": 0}, {"stages": True}, {"stages": "two"}, {"activation_checkpoint_interval": -1},
                {"partitions": "best"}, {"seed_layers": "yes"}):  # fmt: skip
        with pytest.raises(Exception, match="pipeline"):
            parse_config({"train_batch_size": 1, "pipeline": bad})
