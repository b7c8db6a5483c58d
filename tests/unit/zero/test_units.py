import pytest
import torch
import torch.nn as nn

from zeroshard.testing.models import GPT, GPTConfig
from zeroshard.zero.stage3.units import choose_unit_modules, plan_units, repeated_block_classes

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32)


def test_unit_classes_pick_exactly_those_modules():
    assert choose_unit_modules(GPT(CFG), frozenset({"Block"}), 0) == ["blocks.0", "blocks.1", "blocks.2"]


def test_size_threshold_is_bottom_up():
    model = GPT(CFG)
    block = sum(p.numel() for p in model.blocks[0].parameters())
    assert choose_unit_modules(model, frozenset(), block) == ["blocks.0", "blocks.1", "blocks.2"]
    # above a block but below three blocks: the ModuleList is never called, so it is never a unit; the
    # blocks' parameters pass up to the root
    assert choose_unit_modules(model, frozenset(), 2 * block) == []


def test_leftovers_of_a_container_go_to_the_nearest_ancestor_that_runs():
    class Body(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleDict({"a": nn.Linear(8, 8), "b": nn.Linear(8, 8)})

        def forward(self, x):
            return self.layers["b"](self.layers["a"](x))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = Body()
            self.head = nn.Linear(8, 2)

    # each Linear (72 parameters) is below the threshold, the ModuleDict (144) reaches it but never runs
    assert choose_unit_modules(Net(), frozenset(), 100) == ["body"]


def test_container_class_as_unit_class_is_refused():
    with pytest.raises(ValueError, match=r"container class\(es\) \['ModuleList'\]"):
        choose_unit_modules(GPT(CFG), frozenset({"ModuleList"}), 0)


def test_every_parameter_in_exactly_one_unit_and_tied_weights_in_root():
    model = GPT(CFG)
    units = plan_units(model, frozenset({"Block"}))
    assert [u.name for u in units] == ["", "blocks.0", "blocks.1", "blocks.2"]
    seen = [p for u in units for p in u.params]
    assert len(seen) == len(set(seen)) == len(list(model.parameters()))
    assert any(p is model.wte.weight for p in units[0].params)  # tied with lm_head: root
    assert all(any(p is q for q in units[1].params) for p in model.blocks[0].parameters())


class Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(4, 4))
        self.b = nn.Sequential(nn.Linear(4, 4))
        self.b[0].weight = self.a[0].weight  # tied across two units


def test_weight_tied_across_units_moves_to_root():
    model = Shared()
    units = {u.name: u for u in plan_units(model, frozenset({"Sequential"}))}
    assert any(p is model.a[0].weight for p in units[""].params)
    assert not any(p is model.a[0].weight for p in units["a"].params + units["b"].params)


def test_default_units_are_the_repeated_blocks():
    assert plan_units_names(GPT(CFG)) == ["", "blocks.0", "blocks.1", "blocks.2"]


def plan_units_names(model):
    return [u.name for u in plan_units(model)]


def test_repeated_blocks_of_hf_models_and_only_the_outermost():
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=16))
    assert repeated_block_classes(gpt2) == {"GPT2Block"}
    assert plan_units_names(gpt2) == ["", "transformer.h.0", "transformer.h.1"]
    llama = LlamaForCausalLM(
        LlamaConfig(num_hidden_layers=2, hidden_size=16, intermediate_size=32, num_attention_heads=2, vocab_size=32)
    )
    assert repeated_block_classes(llama) == {"LlamaDecoderLayer"}

    class Expert(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(4, 4)

        def forward(self, x):
            return self.up(x)

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList([Expert(), Expert()])

        def forward(self, x):
            return sum(e(x) for e in self.experts)

    stack = nn.Sequential(Layer(), Layer(), nn.Linear(4, 4), nn.Linear(4, 4))  # leaf Linears are no blocks
    assert repeated_block_classes(stack) == {"Layer"}


def test_explicit_size_threshold_overrides_repeated_blocks():
    model = GPT(CFG)
    assert [u.name for u in plan_units(model, min_params=10**9)] == [""]


def test_leaf_modules_are_units_with_nothing_chosen_inside():
    from zeroshard.zero.stage3 import leaf_module_paths, plan_units

    model = GPT(CFG)  # blocks.0-2 are the repeated Block units by default
    leaves = leaf_module_paths(model, classes=["Block"], names=["wte"], name_suffixes=[".1.fc"])
    assert leaves == ["wte", "blocks.0", "blocks.1", "blocks.1.fc", "blocks.2"]
    # blocks.1.fc lies inside the leaf blocks.1: the leaf wins, nothing is chosen inside a leaf
    names = [u.name for u in plan_units(model, frozenset({"Linear"}), None, ("blocks.1",))]
    assert "blocks.1" in names and not any(n.startswith("blocks.1.") for n in names)
    assert "blocks.0.fc" in names  # outside the leaf, the unit classes still apply
    with pytest.raises(ValueError, match=r"leaf modules \['MoEBlock', 'nowhere', '.nothing'\] match no module"):
        leaf_module_paths(model, classes=["MoEBlock"], names=["nowhere"], name_suffixes=[".nothing"])
    assert leaf_module_paths(model, names=["blocks"]) == ["blocks"]  # a container: gathered when a block runs
    holder = nn.Module()
    holder.weights = nn.ParameterList([nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match=r"leaf modules \['weights'\] are containers with no module inside that runs"):
        leaf_module_paths(holder, names=["weights"])


def test_a_container_leaf_is_gathered_by_the_modules_inside_it_that_run():
    from zeroshard.zero.stage3 import plan_units
    from zeroshard.zero.stage3.units import trigger_modules

    model = GPT(CFG)
    assert trigger_modules(model.blocks) == list(model.blocks)
    assert trigger_modules(model.blocks[0]) == [model.blocks[0]]
    units = plan_units(model, frozenset({"Block"}), None, ("blocks",))
    assert [u.name for u in units] == ["", "blocks"]  # one unit: every block's parameters
    assert len(units[1].params) == sum(1 for _ in model.blocks.parameters())


class MLPBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.gate, self.up, self.down = (nn.Linear(width, width, bias=False) for _ in range(3))

    def forward(self, x):
        return self.down(torch.relu(self.gate(x)) * self.up(x))


class FineGrained(nn.Module):
    """DeepSpeed's test model for stage3_module_granularity_threshold, small: two wide layers, then 4 small MLPs."""

    def __init__(self):
        super().__init__()
        self.wide1, self.wide2 = nn.Linear(8, 64), nn.Linear(64, 8)
        self.mlps = nn.ModuleList([MLPBlock(8) for _ in range(4)])

    def forward(self, x):
        x = self.wide2(self.wide1(x))
        for mlp in self.mlps:
            x = mlp(x)
        return x


def test_the_granularity_threshold_chooses_leaves_as_deepspeed_does():
    """Granularity: parameters per layer of a subtree (an MLP block: 3 x 64 / (3 + 1) = 48; the model: 1864 / 19 =
    98, its 16 MLP layers, 2 wide ones and itself); the outermost modules at or under the threshold become leaves,
    containers never; 0 chooses none."""
    from zeroshard.zero.stage3.units import granularity_leaf_paths

    model = FineGrained()
    assert granularity_leaf_paths(model, 0) == [] and granularity_leaf_paths(model, 47) == []
    assert granularity_leaf_paths(model, 48) == [f"mlps.{i}" for i in range(4)]
    assert granularity_leaf_paths(model, 97) == [f"mlps.{i}" for i in range(4)]
    assert granularity_leaf_paths(model, 98) == [""]  # the root: the whole model one unit
