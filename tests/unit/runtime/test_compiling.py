"""Which modules ``engine.compile()`` compiles in place (``choose_regions``, pure) and the checks on its arguments,
before anything is compiled."""

import pytest
import torch
import torch.nn as nn

from zeroshard.runtime.compiling import choose_regions, compile_options
from zeroshard.testing.models import GPT, GPTConfig, recompute_blocks

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32)


def test_stages_0_to_2_compile_the_repeated_blocks():
    assert choose_regions(GPT(CFG), hooked=()) == ["blocks.0", "blocks.1", "blocks.2"]


def test_a_model_without_repeated_blocks_is_compiled_whole():
    assert choose_regions(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)), hooked=()) == [""]


def test_stage_3_compiles_the_units_that_hold_no_other_unit():
    model = GPT(CFG)
    hooked = [model, *model.blocks]  # the root unit and one unit per block (the default)
    assert choose_regions(model, hooked) == ["blocks.0", "blocks.1", "blocks.2"]
    # units chosen by size, inside the blocks: the blocks hold hooks, so the units themselves are compiled
    inner = [model, *(block.fc for block in model.blocks)]
    assert choose_regions(model, inner) == ["blocks.0.fc", "blocks.1.fc", "blocks.2.fc"]
    # one unit for the whole model: its blocks hold no hook, so they are compiled; a model without repeated blocks
    # is compiled whole, its root unit's hooks running around the compiled forward
    assert choose_regions(model, [model]) == ["blocks.0", "blocks.1", "blocks.2"]
    flat = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    assert choose_regions(flat, [flat]) == [""]


def test_wrapped_blocks_are_compiled_at_the_wrapper():
    model = recompute_blocks(GPT(CFG))
    assert choose_regions(model, [model, *model.blocks]) == ["blocks.0", "blocks.1", "blocks.2"]


def test_a_hooked_container_is_never_a_region():
    model = GPT(CFG)
    assert "blocks" not in choose_regions(model, [model, model.blocks])


@pytest.mark.parametrize(
    "backend,kwargs,error,match",
    [
        ("no_such_backend", None, ValueError, r"'no_such_backend'\): not a torch.compile backend"),
        (7, None, TypeError, "a backend is a name"),
        ("inductor", {"fullgrph": True}, TypeError, r"\['fullgrph'\] are not torch.compile options"),
        ("inductor", "fullgraph", TypeError, "takes a dict"),
        ("inductor", {"mode; rm -rf /": 1}, TypeError, "are not torch.compile options"),
    ],
)
def test_bad_arguments_are_named_before_anything_compiles(backend, kwargs, error, match):
    with pytest.raises(error, match=match):
        compile_options(backend, kwargs, "inductor", {})


def test_the_arguments_override_the_config_block_and_backend_in_kwargs_is_dropped():
    backend, options = compile_options(None, {"dynamic": True, "backend": "eager"}, "aot_eager", {"fullgraph": True})
    assert backend == "aot_eager" and options == {"fullgraph": True, "dynamic": True}
    assert compile_options("inductor", None, "aot_eager", {})[0] == "inductor"
    assert callable(compile_options(torch._dynamo.testing.EagerAndRecordGraphs(), None, "inductor", {})[0])


class _Attributes(nn.Module):
    """Blocks registered as attributes, not in a ModuleList (as a PipelineModule registers its layers)."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Sequential(nn.Linear(4, 4)), nn.Sequential(nn.Linear(4, 4))

    def forward(self, x):
        return self.second(self.first(x))


def test_blocks_registered_as_attributes_are_repeated_blocks():
    assert choose_regions(_Attributes(), hooked=()) == ["first", "second"]
