"""Ulysses attention on one process: the head rule, the byte formula, what registration refuses, and the position
check (a one-rank group: the exchanges are the identity, so the wrapper must give the core attention's output)."""

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from zeroshard.comm import Group
from zeroshard.sequence_parallel import (
    HeadLayout,
    UlyssesAttention,
    attention_all_to_all_bytes,
    register_with_transformers,
)
from zeroshard.testing.hf import tiny_causal_lm


def test_head_layout_splits_or_repeats_key_value_heads():
    assert (HeadLayout(8, 8, 4).local_heads, HeadLayout(8, 8, 4).local_kv_heads) == (2, 2)
    gqa = HeadLayout(4, 2, 4)  # 2 key-value heads on 4 ranks: each repeated twice
    assert (gqa.kv_repeats, gqa.local_heads, gqa.local_kv_heads) == (2, 1, 1)
    assert HeadLayout(4, 1, 2).kv_repeats == 2  # multi-query
    with pytest.raises(ValueError, match="6 attention heads do not divide over sequence_parallel_size 4"):
        HeadLayout(6, 2, 4)
    with pytest.raises(ValueError, match="6 key-value heads and sequence_parallel_size 4: one must divide the other"):
        HeadLayout(12, 6, 4)


def test_all_to_all_bytes_count_q_k_v_and_the_output_both_ways():
    # batch 2, 8 local tokens, head dim 16, fp32: per head 2*8*16*4 = 1024 bytes; (4 q + 4 kv (2 repeated) ) x 2 + ...
    assert attention_all_to_all_bytes(2, 8, 16, HeadLayout(4, 2, 4), 4) == 2 * 1024 * (2 * 4 + 2 * 4)
    assert attention_all_to_all_bytes(2, 8, 16, HeadLayout(4, 2, 2), 4) == 2 * 1024 * (2 * 4 + 2 * 2)


def _attention(local: int = 8):
    torch.manual_seed(0)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal, module.layer_idx = 2, True, 0
    q, k, v = torch.randn(1, 4, local, 16), torch.randn(1, 2, local, 16), torch.randn(1, 2, local, 16)
    return module, q, k, v


def test_one_rank_wrapper_is_the_core_attention_and_checks_positions():
    wrapper = UlyssesAttention(sdpa_attention_forward, "sdpa", HeadLayout(4, 2, 1), Group("sequence", (0,), None))
    module, q, k, v = _attention()
    expected, _ = sdpa_attention_forward(module, q, k, v, None)
    got, _ = wrapper(module, q, k, v, torch.zeros(1, 1, 8, 8), position_ids=torch.arange(8)[None])
    assert torch.equal(got, expected)  # the local mask is dropped: attention is causal over the whole sequence
    with pytest.raises(ValueError, match="needs position_ids"):
        wrapper(module, q, k, v, None)
    packed = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
    with pytest.raises(ValueError, match="packed samples .* are not supported with sdpa"):
        wrapper(module, q, k, v, None, position_ids=packed)
    with pytest.raises(ValueError, match="registered for 4 query / 2 key-value heads and got 4 / 4"):
        wrapper(module, q, torch.cat([k, k], 1), v, None, position_ids=torch.arange(8)[None])


def test_registration_refuses_what_it_cannot_run_before_building_groups():
    sdpa = tiny_causal_lm("llama", attn_implementation="sdpa")
    assert register_with_transformers(sdpa, "sdpa", 1, 1) is None  # 1: off, as DeepSpeed
    with pytest.raises(ValueError, match="'eager' is not supported under Ulysses"):
        register_with_transformers(tiny_causal_lm("llama", attn_implementation="eager"), "eager", 2, 1)
    with pytest.raises(ValueError, match="core_attn_implementation 'sdpa' but the model runs 'eager'"):
        register_with_transformers(tiny_causal_lm("llama", attn_implementation="eager"), "sdpa", 2, 1)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="'flash_attention_2' needs a CUDA device"):
            register_with_transformers(tiny_causal_lm("llama"), "flash_attention_2", 2, 1)
    with pytest.raises(ValueError, match="'flex_attention' is not supported under Ulysses"):
        register_with_transformers(tiny_causal_lm("llama"), "flex_attention", 2, 1)
    with pytest.raises(TypeError, match="sequence_parallel_size must be an int"):
        register_with_transformers(sdpa, "sdpa", 2.0, 1)
    with pytest.raises(ValueError, match="micro_batch_size must be a positive int"):
        register_with_transformers(sdpa, "sdpa", 2, 0)
    with pytest.raises(ValueError, match="seq_length_is_variable=False needs seq_length="):
        register_with_transformers(sdpa, "sdpa", 2, 1, seq_length_is_variable=False)
    with pytest.raises(ValueError, match="seq_length 63 does not divide over sequence_parallel_size 2"):
        register_with_transformers(sdpa, "sdpa", 2, 1, seq_length=63)
    with pytest.raises(TypeError, match="model_name_or_path must be a model with a .config"):
        register_with_transformers(42, "sdpa", 2, 1)
    with pytest.raises(RuntimeError, match="needs the process group"):
        register_with_transformers(sdpa, "sdpa", 2, 1)  # the checks passed; building groups needs ranks


def test_deepspeeds_class_name_is_native_and_served_as_deepspeed():
    from zeroshard.compat.deepspeed.runtime.sequence_parallel import ulysses_sp
    from zeroshard.sequence_parallel import UlyssesSPAttentionHF

    assert ulysses_sp.UlyssesSPAttentionHF is UlyssesSPAttentionHF
    model = tiny_causal_lm("llama", attn_implementation="sdpa")
    assert UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 1, 1) is None
    deprecated = pytest.warns(UserWarning, match=r"max_length=\) is deprecated")
    with deprecated, pytest.raises(ValueError, match="seq_length 63"):
        UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 2, 1, max_length=63)
