"""zeroshard.runtime.activation_checkpointing (DeepSpeed's activation-checkpointing API) on one process."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from zeroshard.runtime import activation_checkpointing as checkpointing
from zeroshard.testing.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=128, block_size=64, n_layer=4, n_head=4, n_embd=64)


@pytest.fixture(autouse=True)
def _defaults():
    checkpointing.reset()
    yield
    checkpointing.reset()


class Checkpointed(torch.nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return checkpointing.checkpoint(self.block, x)


def _models():
    torch.manual_seed(0)
    plain = GPT(CFG)
    torch.manual_seed(0)
    recomputed = GPT(CFG)
    recomputed.blocks = torch.nn.ModuleList(Checkpointed(b) for b in recomputed.blocks)
    return plain, recomputed


def _bytes_held_after_forward(model, x):
    """Bytes allocated during forward and still held at its end: what autograd keeps for backward."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = model(x, x)
    return sum(e.self_cpu_memory_usage for e in prof.key_averages()), loss


def test_configure_reads_the_config_block_and_keywords_override_it():
    assert not checkpointing.is_configured()
    block = {"activation_checkpointing": {"cpu_checkpointing": True, "profile": True, "number_checkpoints": 4}}
    checkpointing.configure(deepspeed_config={"train_batch_size": 1, **block}, profile=False)
    assert checkpointing.is_configured()
    from zeroshard.runtime import activation_checkpointing as ac

    assert ac._configured == ac.CheckpointingOptions(cpu_checkpointing=True, profile=False, number_checkpoints=4)
    checkpointing.reset()
    assert not checkpointing.is_configured()


def test_contiguous_checkpointing_is_satisfied_as_deepspeeds_pipe_tests_set_it():
    block = {"activation_checkpointing": {"contiguous_memory_optimization": True, "partition_activations": True}}
    config = {"train_batch_size": 1, **block}
    checkpointing.configure(deepspeed_config=config, contiguous_checkpointing=True)  # TestPipeModuleSequential's
    from zeroshard.config import parse_config

    assert parse_config(config).activation_checkpointing.contiguous_memory_optimization is True
    checkpointing.reset()


def test_what_cannot_work_is_refused_by_name():

    class MPU:
        def __init__(self, size):
            self.size = size

        def get_model_parallel_world_size(self):
            return self.size

    with pytest.raises(NotImplementedError, match="2 model-parallel ranks"):
        checkpointing.configure(mpu_=MPU(2), partition_activations=True)
    checkpointing.configure(mpu_=MPU(1), partition_activations=True)  # one model-parallel rank: nothing to split
    assert checkpointing.is_configured()


@pytest.mark.parametrize("options", [{}, {"checkpoint_in_cpu": True, "synchronize": True, "profile": True}])
def test_recomputation_gives_the_same_gradients_and_keeps_only_block_inputs(options):
    if options:
        checkpointing.configure(**options)
    plain, recomputed = _models()
    x = torch.randint(0, CFG.vocab_size, (4, CFG.block_size))
    held_plain, loss_plain = _bytes_held_after_forward(plain, x)
    held_recomputed, loss_recomputed = _bytes_held_after_forward(recomputed, x)
    loss_plain.backward()
    loss_recomputed.backward()
    assert torch.equal(loss_plain, loss_recomputed)
    names = {name.replace(".block.", "."): p for name, p in recomputed.named_parameters()}
    for name, param in plain.named_parameters():
        assert torch.equal(param.grad, names[name].grad), name
    block_input = 4 * CFG.block_size * CFG.n_embd * 4  # one fp32 (batch, sequence, width) tensor
    assert held_recomputed >= CFG.n_layer * block_input  # each block's input is kept
    # each block keeps ~18 such tensors without recomputation; outside the blocks the logits dominate
    assert held_plain / held_recomputed > 5, (held_plain, held_recomputed)


def test_the_deepspeed_names_are_the_same_functions():
    from zeroshard.compat.deepspeed import checkpointing as ds

    assert ds.checkpoint is checkpointing.checkpoint
    assert ds.non_reentrant_checkpoint is ds.checkpoint
    assert ds.configure is checkpointing.configure and ds.reset is checkpointing.reset


def test_an_engines_options_apply_inside_its_forward_only():
    """What ``in_effect`` sets (an engine's config block) wins over ``configure`` inside it, and only there."""
    checkpointing.configure(checkpoint_in_cpu=False, profile=False)
    engine_options = checkpointing.options_from({"activation_checkpointing": {"profile": True}})
    assert engine_options.profile and not engine_options.cpu_checkpointing
    seen = []

    def segment(x):
        seen.append(checkpointing._engine_options.get() or checkpointing._configured)
        return x * x  # saves x: backward recomputes it

    x = torch.ones(2, requires_grad=True)
    with checkpointing.in_effect(engine_options):
        checkpointing.checkpoint(segment, x).sum().backward()
    checkpointing.checkpoint(segment, x).sum().backward()
    assert [o.profile for o in seen] == [True, True, False, False]  # forward and recomputation each
    checkpointing.reset()
    assert not checkpointing.is_configured()
    with checkpointing.in_effect(engine_options):
        assert checkpointing.is_configured()


def test_profile_logs_the_forward_and_the_recomputation():
    """torch stops a recomputation early by raising inside the function; its time is still logged."""
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("zeroshard")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        checkpointing.configure(profile=True)
        layer = torch.nn.Linear(4, 4)
        x = torch.randn(2, 4, requires_grad=True)
        checkpointing.checkpoint(lambda t: torch.tanh(layer(t)) * 2, x).sum().backward()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    phases = [m.split(": ")[1].split()[0] for m in records if m.startswith("activation checkpoint")]
    assert phases == ["forward", "recompute"], records
