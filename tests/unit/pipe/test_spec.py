"""DeepSpeed's layer specifications: built on demand with their arguments; a class that is not a module, or a tied
spec without a key, is a named error before anything is built."""

import pytest
import torch

from zeroshard.pipe import LayerSpec, TiedLayerSpec


def test_a_spec_builds_its_module_when_asked():
    spec = LayerSpec(torch.nn.Linear, 4, 3, bias=False)
    layer = spec.build()
    assert isinstance(layer, torch.nn.Linear) and layer.bias is None and layer.weight.shape == (3, 4)
    assert repr(spec) == "Linear(4, 3, bias=False)"
    assert spec.build() is not layer


def test_a_tied_spec_names_its_key_and_weights():
    tied = TiedLayerSpec("embed", torch.nn.Embedding, 10, 4, tied_weight_attr="weight")
    assert (tied.key, tied.tied_weight_attr, tied.forward_fn) == ("embed", ["weight"], None)
    head = TiedLayerSpec("embed", torch.nn.Embedding, 10, 4, forward_fn=lambda module, x: x @ module.weight.t())
    assert callable(head.forward_fn)


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: LayerSpec(torch.relu), "torch.nn.Module classes"),
        (lambda: LayerSpec(torch.nn.Linear(2, 2)), "torch.nn.Module classes"),
        (lambda: LayerSpec("os.system"), "torch.nn.Module classes"),
        (lambda: TiedLayerSpec("", torch.nn.Linear, 2, 2), "non-empty string"),
        (lambda: TiedLayerSpec(None, torch.nn.Linear, 2, 2), "non-empty string"),
        (lambda: TiedLayerSpec("k", torch.nn.Linear, 2, 2, forward_fn=3), "callable"),
        (lambda: TiedLayerSpec("k", torch.nn.Linear, 2, 2, tied_weight_attr=[]), "names attributes"),
    ],
)
def test_bad_specs_are_named_errors(build, message):
    with pytest.raises(TypeError, match=message):
        build()


def test_deepspeeds_names_are_zeroshards():
    """In compat mode ``deepspeed.pipe``'s module, specs and topologies are zeroshard's (a client subclass of
    ``PipelineModule`` builds: ``tests/unit/pipe/test_module.py``)."""
    from zeroshard import pipe
    from zeroshard.compat.deepspeed import pipe as ds_pipe
    from zeroshard.compat.deepspeed.runtime.pipe import module, topology

    assert (ds_pipe.LayerSpec, ds_pipe.TiedLayerSpec) == (pipe.LayerSpec, pipe.TiedLayerSpec)
    assert ds_pipe.PipelineModule is module.PipelineModule is pipe.PipelineModule
    assert topology.PipeModelDataParallelTopology is pipe.PipeModelDataParallelTopology
