"""Tiny Hugging Face models of the families the tests exercise, one place for their shapes (transformers is
imported on use: it is an optional dependency)."""

from __future__ import annotations

from typing import Any

import torch

# every family: 2 layers, 4 query heads sharing 2 key/value heads where the family has grouped-query attention
_SHAPES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2),
    ),
    "qwen3": (  # per-head q_norm / k_norm
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8),
    ),
    "mixtral": (  # 4 experts, one per token: with few tokens some experts see none
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(
            hidden_size=16,
            intermediate_size=32,
            num_attention_heads=2,
            num_key_value_heads=1,
            num_local_experts=4,
            num_experts_per_tok=1,
        ),
    ),
    "qwen3_moe": (  # 8 experts, top-2, every layer sparse
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            hidden_size=16,
            intermediate_size=32,
            moe_intermediate_size=24,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            num_experts=8,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        ),
    ),
}


def tiny_causal_lm(family: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A freshly initialized tiny causal LM of ``family`` (``llama``, ``qwen3``, ``mixtral``, ``qwen3_moe``) with a
    64-token vocabulary and 2 layers, its weights drawn under ``seed``; ``overrides`` change config fields."""
    import transformers

    if family not in _SHAPES:
        raise ValueError(f"unknown family {family!r}; known: {sorted(_SHAPES)}")
    config_class, model_class, shape = _SHAPES[family]
    fields = dict(vocab_size=64, num_hidden_layers=2, max_position_embeddings=32, **shape)
    config = getattr(transformers, config_class)(**{**fields, **overrides})
    torch.manual_seed(seed)
    return getattr(transformers, model_class)(config)
