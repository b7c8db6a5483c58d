"""LoRA fine-tuning (real `peft`) under ZeRO stage 3 on 2 and 4 Gloo ranks: the frozen base model is sharded like
the trainable parameters (1/N per rank), the adapters train to parity with single-process training, and the
merged model equals the reference's."""

import pytest
import torch

from zeroshard.testing import run_distributed
from zeroshard.testing.parity import model_error

pytest.importorskip("peft")

STEPS, BATCH, SEQ, VOCAB, LR = 3, 4, 16, 96, 1e-3  # BATCH: the global batch, split across the ranks


def lora_model(kind: str):
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "gpt2":
        base = GPT2LMHeadModel(
            GPT2Config(
                n_layer=2,
                n_embd=32,
                n_head=2,
                vocab_size=VOCAB,
                n_positions=SEQ,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
            )
        )
        lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True)
    else:
        base = LlamaForCausalLM(
            LlamaConfig(
                num_hidden_layers=2,
                hidden_size=32,
                intermediate_size=64,
                num_attention_heads=2,
                num_key_value_heads=2,
                vocab_size=VOCAB,
                max_position_embeddings=SEQ,
            )
        )
        lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "up_proj"])
    torch.manual_seed(1)  # the adapters' initial values (B starts at zero, A random)
    return get_peft_model(base, lora)


def batches():
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen) for _ in range(STEPS)]


def reference(kind: str) -> dict:
    model = lora_model(kind)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.01)
    for ids in batches():
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, model.merge_and_unload().state_dict()


def lora_worker(kinds: list) -> dict:
    import zeroshard
    from zeroshard import comm

    rank, world = comm.get_rank(), comm.get_world_size()
    out = {}
    for kind in kinds:
        model = lora_model(kind)
        frozen_numel = sum(p.numel() for p in model.parameters() if not p.requires_grad)
        config = {
            "train_micro_batch_size_per_gpu": BATCH // world,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        }
        engine, *_ = zeroshard.initialize(model=model, config=config)
        frozen = engine.stack.frozen_groups
        held = {
            "frozen_shard_numel": sum(f.layout.shard_numel for f in frozen),
            "frozen_padding": sum(f.layout.padded_numel - f.layout.numel for f in frozen),
            "frozen_numel": frozen_numel,
            "groups": len(frozen),
            "sharded": all(p.ds_status.name == "NOT_AVAILABLE" for p in model.parameters() if not p.requires_grad),
        }
        units = engine.stage3
        # every unit's flat groups (trainable and frozen) gathered once in forward and once in backward, the root's
        # and (from the second step) the last layer's once: a frozen weight still needed after its unit's adapters
        # got their gradients is not gathered again
        last = len(units.units[-1].flats)
        held["expected_gathers"] = 2 * sum(len(u.flats) for u in units.units) + len(units.root_unit.flats) - last
        b = BATCH // world
        for ids in batches():
            engine.comm_ledger.reset()
            mine = ids[rank * b : (rank + 1) * b]
            engine.backward(engine(input_ids=mine, labels=mine).loss)
            engine.step()
        held["gathers"] = engine.comm_ledger.summary()[("all_gather", "shard")].calls
        out[kind] = {"state": engine.consolidated_state_dict(rank0_only=False), **held}
        engine.destroy()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_lora_under_stage3_shards_the_frozen_base_and_trains_to_parity(world):
    results = run_distributed(lora_worker, world, ["gpt2", "llama"], timeout_s=600)
    for kind in ("gpt2", "llama"):
        expected, expected_merged = reference(kind)
        for rank, result in enumerate(results):
            got = result[kind]
            assert got["sharded"], (kind, rank)
            assert got["gathers"] == got["expected_gathers"], (kind, rank)
            # each rank holds 1/N of the frozen base, plus at most one alignment's padding per flat group
            assert got["frozen_shard_numel"] * world == got["frozen_numel"] + got["frozen_padding"]
            assert got["frozen_padding"] < world * 16 * got["groups"]
            assert model_error(got["state"], expected) <= 1e-5, (kind, rank)
        trained = lora_model(kind)
        trained.load_state_dict(results[0][kind]["state"])
        merged = trained.merge_and_unload().state_dict()
        assert model_error(merged, expected_merged) <= 1e-5, kind


def save_worker(path: str) -> dict:
    import zeroshard

    model = lora_model("gpt2")
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = zeroshard.initialize(model=model, config=config)
    ids = batches()[0][:1]
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.save_checkpoint(path, tag="full")
    engine.save_checkpoint(path, tag="adapters", exclude_frozen_parameters=True)
    return engine.consolidated_state_dict(rank0_only=False)


def load_worker(path: str) -> dict:
    import zeroshard

    out = {}
    for tag in ("full", "adapters"):
        model = lora_model("gpt2")
        with torch.no_grad():
            for p in model.parameters():
                if not p.requires_grad:
                    p.add_(1.0)  # a different base: only a checkpoint holding the frozen weights restores them
        perturbed = {k: v.clone() for k, v in model.state_dict().items()}
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": LR}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        }
        engine, *_ = zeroshard.initialize(model=model, config=config)
        engine.load_checkpoint(path, tag=tag)
        out[tag] = engine.consolidated_state_dict(rank0_only=False)
        out[f"{tag}_perturbed"] = perturbed
        engine.destroy()
    return out


def test_frozen_shards_save_and_reshard_from_2_to_4_ranks(tmp_path):
    saved = run_distributed(save_worker, 2, str(tmp_path))[0]
    loaded = run_distributed(load_worker, 4, str(tmp_path))[0]
    assert all(torch.equal(loaded["full"][k], v) for k, v in saved.items())
    # without the frozen weights in the checkpoint the model keeps its own base, and takes the saved adapters
    for name, value in loaded["adapters"].items():
        want = saved[name] if "lora_" in name else loaded["adapters_perturbed"][name]
        assert torch.equal(value, want), name
