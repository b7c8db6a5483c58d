"""Activation checkpointing through activation_checkpointing.checkpoint (configured by the config block) and
through a Hugging Face model's gradient_checkpointing_enable(), under ZeRO stages 0-3, on 2 Gloo ranks."""

import torch

from zeroshard.testing import run_distributed
from zeroshard.testing.models import recompute_blocks
from zeroshard.testing.parity import ParityCase, make_batches, make_model, model_error, reference_train

BLOCK = {"activation_checkpointing": {"cpu_checkpointing": True, "synchronize_checkpoint_boundary": True}}


def stages_worker(steps: int) -> dict:
    """Each stage trains the example GPT with every block recomputed; the config block configures checkpointing."""
    import zeroshard
    from zeroshard import comm
    from zeroshard.runtime import activation_checkpointing

    rank, out = comm.get_rank(), {}
    for stage in (0, 1, 2, 3):
        case = ParityCase(stage=stage, steps=steps, lr=1e-3, extra=tuple(BLOCK.items()))
        activation_checkpointing.reset()
        model = recompute_blocks(make_model())
        engine, *_ = zeroshard.initialize(model=model, config=case.config())
        options = engine.activation_checkpointing  # the block configures the engine's checkpointing
        assert options.cpu_checkpointing and options.synchronize
        b = case.micro_batch
        for x, y in make_batches(steps, 2 * b):
            engine.backward(engine(x[rank * b : (rank + 1) * b], y[rank * b : (rank + 1) * b]))
            engine.step()
        state = engine.consolidated_state_dict(rank0_only=False)
        out[stage] = {k.replace(".block.", "."): v for k, v in state.items()}
        engine.destroy()
    return out


def test_recomputed_blocks_train_to_parity_under_every_stage():
    expected = reference_train(ParityCase(stage=0, steps=2, lr=1e-3), 2)
    for stage, state in run_distributed(stages_worker, 2, 2)[0].items():
        assert model_error(state, expected) <= 1e-5, stage


def hf_worker() -> dict:
    """A GPT-2 built under zero.Init, trained under stage 3 with and without gradient_checkpointing_enable()."""
    from transformers import GPT2Config, GPT2LMHeadModel

    import zeroshard
    from zeroshard import comm

    config = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=16, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
    )
    rank, results = comm.get_rank(), {}
    for recompute in (False, True):
        torch.manual_seed(0)
        with zeroshard.zero.Init():
            model = GPT2LMHeadModel(config)
        if recompute:
            model.gradient_checkpointing_enable()
        ds = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        }
        engine, *_ = zeroshard.initialize(model=model, config=ds)
        engine.train()
        gen = torch.Generator().manual_seed(7)
        for _ in range(2):
            ids = torch.randint(0, 96, (4, 16), generator=gen)[2 * rank : 2 * rank + 2]
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
        results[recompute] = engine.consolidated_state_dict(rank0_only=False)
        engine.destroy()
    return results


def test_hf_gradient_checkpointing_under_stage3_with_zero_init():
    results = run_distributed(hf_worker, 2)[0]
    assert model_error(results[True], results[False]) <= 1e-6
