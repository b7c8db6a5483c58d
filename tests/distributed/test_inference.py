"""Tensor-parallel inference on real ranks against the unsharded model (fp32: logits within 1e-5, greedy
generation identical with and without the KV cache), for real Hugging Face classes and a plain model."""

import pytest
import torch
import transformers
from torch import nn

from zeroshard.testing import run_distributed

VOCAB = 101  # not divisible by 2 or 4: the vocabulary slices are padded
TOLERANCE = 1e-5


def hf_model(kind: str, seed: int = 0, meta: bool = False):
    configs = {
        "gpt2": lambda: transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64, bos_token_id=0, eos_token_id=0
        ),
        "llama": lambda: transformers.LlamaConfig(  # grouped-query attention: 8 query heads, 4 key/value heads
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=96,
            num_attention_heads=8,
            num_key_value_heads=4,
            vocab_size=VOCAB,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        ),
        "opt": lambda: transformers.OPTConfig(
            num_hidden_layers=2,
            hidden_size=64,
            ffn_dim=128,
            num_attention_heads=4,
            vocab_size=VOCAB,
            max_position_embeddings=64,
            word_embed_proj_dim=64,
        ),
    }
    cls = {
        "gpt2": transformers.GPT2LMHeadModel,
        "llama": transformers.LlamaForCausalLM,
        "opt": transformers.OPTForCausalLM,
    }
    config = configs[kind]()
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    if meta:
        import zeroshard

        with zeroshard.init_empty_weights():
            return cls[kind](config)
    return cls[kind](config).eval()


def analytic_bytes(model: nn.Module, plan, tp: int) -> int:
    """The 1/tp share of every sharded weight (column: weight and bias; row: weight; vocabulary: padded rows)
    plus every replicated tensor whole, fp32, tied weights once."""
    sharded = {}
    for layer in plan.layers:
        module = model.get_submodule(layer.name)
        if layer.style.startswith("vocab"):
            rows = -(-module.weight.shape[0] // tp)
            sharded[module.weight] = rows * module.weight.shape[1]
            if getattr(module, "bias", None) is not None:
                sharded[module.bias] = rows
        else:
            sharded[module.weight] = module.weight.numel() // tp
            if module.bias is not None:
                sharded[module.bias] = module.bias.numel() // tp if layer.style == "column" else module.bias.numel()
    return 4 * sum(sharded.get(p, p.numel()) for p in model.parameters())


def prompts():
    return torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))


def auto_tp_worker(tp: int, kinds: list[str]) -> dict:
    import zeroshard
    from zeroshard.tensor_parallel import plan_tensor_parallel

    out = {}
    ids = prompts()
    for kind in kinds:
        reference = hf_model(kind)
        expected_bytes = analytic_bytes(reference, plan_tensor_parallel(reference, tp), tp)
        with torch.no_grad():
            logits = reference(ids).logits
            greedy = reference.generate(ids[:1], max_new_tokens=20, do_sample=False, pad_token_id=0)
        engine = zeroshard.init_inference(hf_model(kind), tensor_parallel={"tp_size": tp}, dtype=torch.float32)
        out[kind] = {
            "logits_error": (engine(ids).logits - logits).abs().max().item(),
            "greedy_cached": torch.equal(engine.generate(ids[:1], max_new_tokens=20, do_sample=False), greedy),
            "greedy_uncached": torch.equal(
                engine.generate(ids[:1], max_new_tokens=20, do_sample=False, use_cache=False), greedy
            ),
            "sampled": engine.generate(ids[:1], max_new_tokens=8, do_sample=True, top_k=5).tolist(),
            "bytes": engine.parameter_bytes(),
            "expected_bytes": expected_bytes,
            "full_bytes": 4 * sum(p.numel() for p in reference.parameters()),
        }
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_hf_models_match_unsharded(tp):
    kinds = ["gpt2", "llama", "opt"]
    results = run_distributed(auto_tp_worker, tp, tp, kinds, timeout_s=600)
    for kind in kinds:
        r = results[0][kind]
        assert r["logits_error"] <= TOLERANCE, (kind, r["logits_error"])
        assert r["greedy_cached"] and r["greedy_uncached"], kind
        assert r["bytes"] == r["expected_bytes"] and r["bytes"] < r["full_bytes"] * (0.75 if tp == 2 else 0.5), kind
        assert all(results[rank][kind]["sampled"] == r["sampled"] for rank in range(tp)), "ranks sampled apart"


class Attention(nn.Module):
    def __init__(self, width: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.q, self.k, self.v = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width)
        self.out_proj = nn.Linear(width, width)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.n_head, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, width: int, n_head: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = Attention(width, n_head)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class PlainTransformer(nn.Module):
    """No Hugging Face naming: placed by an explicit injection policy."""

    def __init__(self, vocab=VOCAB, width=32, n_head=4, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, n_head) for _ in range(layers))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids, targets=None):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        if targets is None:
            return logits
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


POLICY = {Block: ("attn.out_proj", "mlp.2")}


def plain_worker(tmp: str) -> dict:
    import zeroshard

    ids = prompts()
    torch.manual_seed(0)
    reference = PlainTransformer().eval()
    torch.manual_seed(0)
    engine = zeroshard.init_inference(PlainTransformer(), tensor_parallel={"tp_size": 2}, injection_policy=POLICY)
    plain = (engine(ids) - reference(ids)).abs().max().item()
    replicated = 4 * sum(p.numel() for n, p in reference.named_parameters() if not n.startswith("blocks"))
    sharded = 4 * sum(p.numel() for n, p in reference.named_parameters() if n.startswith("blocks"))
    biases = 4 * sum(p.numel() for n, p in reference.named_parameters() if n.endswith(("out_proj.bias", "mlp.2.bias")))
    norms = 4 * sum(p.numel() for n, p in reference.named_parameters() if "norm" in n)
    expected = replicated + norms + biases + (sharded - norms - biases) // 2

    # a zeroshard training checkpoint, served by the same ranks
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    config["zero_optimization"] = {"stage": 3}
    trainer, *_ = zeroshard.initialize(model=PlainTransformer(), config=config)
    for _ in range(2):
        trainer.backward(trainer(ids, ids))
        trainer.step()
    trainer.save_checkpoint(tmp)
    trained = PlainTransformer()
    trained.load_state_dict(zeroshard.checkpoint.get_fp32_state_dict_from_zero_checkpoint(tmp))
    with zeroshard.init_empty_weights():
        empty = PlainTransformer()
    served = zeroshard.init_inference(
        empty, config={"tensor_parallel": {"tp_size": 2}}, checkpoint=tmp, injection_policy=POLICY
    )
    from_checkpoint = (served(ids) - trained.eval()(ids)).abs().max().item()
    changed = (trained(ids) - reference(ids)).abs().max().item()
    if torch.distributed.get_rank() == 0:  # the same weights as one consolidated safetensors file
        zeroshard.checkpoint.convert_zero_checkpoint_to_fp32_state_dict(tmp, f"{tmp}/served.safetensors")
    torch.distributed.barrier()
    with zeroshard.init_empty_weights():
        empty = PlainTransformer()
    single = zeroshard.init_inference(empty, mp_size=2, checkpoint=f"{tmp}/served.safetensors", injection_policy=POLICY)
    from_file = (single(ids) - trained(ids)).abs().max().item()
    return {
        "plain": plain,
        "bytes": engine.parameter_bytes(),
        "expected": expected,
        "from_checkpoint": from_checkpoint,
        "from_file": from_file,
        "changed": changed,
    }


def test_plain_model_with_injection_policy_and_training_checkpoint(tmp_path):
    r = run_distributed(plain_worker, 2, str(tmp_path / "ckpt"), timeout_s=600)[0]
    assert r["plain"] <= TOLERANCE and r["bytes"] == r["expected"]
    assert r["from_checkpoint"] <= TOLERANCE and r["changed"] > 1e-3  # the served weights are the trained ones
    assert r["from_file"] <= TOLERANCE


def loading_worker(directory: str) -> dict:
    import zeroshard

    ids = prompts()
    out = {}
    for kind in ("gpt2", "llama"):
        reference = hf_model(kind, seed=3)
        with torch.no_grad():
            logits = reference(ids).logits
        if torch.distributed.get_rank() == 0:
            reference.save_pretrained(f"{directory}/{kind}", max_shard_size="100KB")  # sharded, tied weights once
        torch.distributed.barrier()
        model = hf_model(kind, meta=True)
        assert all(p.is_meta for p in model.parameters())
        engine = zeroshard.init_inference(model, tensor_parallel={"tp_size": 2}, checkpoint=f"{directory}/{kind}")
        from_dir = (engine(ids).logits - logits).abs().max().item()
        state = zeroshard.init_inference(hf_model(kind, meta=True), mp_size=2, checkpoint=reference.state_dict())
        from_state = (state(ids).logits - logits).abs().max().item()
        bf16 = zeroshard.init_inference(hf_model(kind, seed=3), tensor_parallel={"tp_size": 2}, dtype="bf16")
        bf16_logits = bf16(ids).logits
        fp16 = zeroshard.init_inference(hf_model(kind, seed=3), tensor_parallel={"tp_size": 2}, dtype=torch.float16)
        fp16_logits = fp16(ids).logits
        out[kind] = {
            "from_dir": from_dir,
            "from_state": from_state,
            "bf16_dtype": str(next(bf16.module.parameters()).dtype),
            "bf16_error": (bf16_logits.float() - logits).abs().max().item() / logits.abs().max().item(),
            "fp16_error": (fp16_logits.float() - logits).abs().max().item() / logits.abs().max().item(),
        }
    try:
        zeroshard.init_inference(hf_model("gpt2", meta=True), tensor_parallel={"tp_size": 2})
    except Exception as err:  # the message is the point
        out["meta_without_checkpoint"] = str(err)
    return out


def test_loading_from_hf_directory_state_dict_and_half_precision(tmp_path):
    r = run_distributed(loading_worker, 2, str(tmp_path), timeout_s=600)[0]
    for kind in ("gpt2", "llama"):
        assert r[kind]["from_dir"] <= TOLERANCE and r[kind]["from_state"] <= TOLERANCE, kind
        assert r[kind]["bf16_dtype"] == "torch.bfloat16" and r[kind]["bf16_error"] < 0.05, kind
        assert r[kind]["fp16_error"] < 0.01, kind
    assert "on the meta device: pass checkpoint=" in r["meta_without_checkpoint"]


def wrong_world_worker() -> str:
    import zeroshard

    try:
        zeroshard.init_inference(hf_model("gpt2"), tensor_parallel={"tp_size": 2})
    except ValueError as err:
        return str(err)
    return "no error"


def test_tp_size_must_divide_the_ranks():
    message = run_distributed(wrong_world_worker, 1, timeout_s=300)[0]
    assert "tp_size 2 must divide the number of ranks 1" in message and "--num_gpus 2" in message
