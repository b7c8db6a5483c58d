"""The flops profiler: exact counts for linear layers, a GPT block against its analytic count, the report's
options, and hostile arguments (a profile never overwrites a file that is not a profile)."""

import pytest
import torch
import torch.nn as nn

from zeroshard.compat.deepspeed.profiling.flops_profiler import FlopsProfiler, get_model_profile
from zeroshard.testing.models import Block, GPTConfig


def test_linear_layers_count_two_n_a_b_exactly():
    n, a, b = 7, 13, 5
    flops, macs, params = get_model_profile(nn.Linear(a, b), input_shape=(n, a), print_profile=False, as_string=False)
    assert (flops, macs, params) == (2 * n * a * b, n * a * b, a * b + b)
    model = nn.Sequential(nn.Linear(a, 16), nn.ReLU(), nn.Linear(16, b, bias=False))
    flops, _, _ = get_model_profile(model, args=[torch.randn(3, 4, a)], print_profile=False, as_string=False)
    assert flops == 2 * 12 * a * 16 + 2 * 12 * 16 * b


def test_a_gpt_block_is_within_one_percent_of_its_analytic_count():
    batch, seq, c = 2, 16, 64
    block = Block(GPTConfig(n_embd=c, n_head=4))
    tokens = batch * seq
    # qkv (c -> 3c), proj (c -> c), fc (c -> 4c), fc_out (4c -> c): 12 c^2 multiply-adds per token;
    # attention: q k^T and the weighted sum of v, each 2 * batch * seq^2 * c
    analytic = 2 * tokens * 12 * c * c + 4 * batch * seq * seq * c
    flops, _, _ = get_model_profile(block, input_shape=(batch, seq, c), print_profile=False, as_string=False)
    assert abs(flops - analytic) <= 0.01 * analytic, (flops, analytic)


def test_the_report_follows_depth_top_modules_and_detailed(capsys, tmp_path):
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8)), nn.Linear(8, 2))
    profiler = FlopsProfiler(model)
    profiler.start_profile()
    model(torch.randn(3, 4))
    profiler.stop_profile()
    assert profiler.get_total_flops() == 2 * 3 * (4 * 8 + 8 * 8 + 8 * 2)
    assert profiler.get_total_flops(as_string=True) == "672 FLOPs" and profiler.get_total_macs() == 336
    profiler.print_model_profile(profile_step=3, module_depth=1, top_modules=2, detailed=True)
    text = capsys.readouterr().out
    assert text.startswith("zeroshard flops profile\nprofile step: 3")
    assert "depth 1: 0 576 FLOPs, 1 96 FLOPs" in text and "depth 2" not in text  # top 2 at depth 1, no deeper
    assert "  0 (Sequential)" in text and "    0 (Linear)" not in text  # the tree stops at depth 1
    profiler.print_model_profile(detailed=False, output_file=str(tmp_path / "profile.txt"))
    written = (tmp_path / "profile.txt").read_text()
    assert written.startswith("zeroshard flops profile") and "per module" not in written
    profiler.print_model_profile(output_file=tmp_path / "profile.txt")  # an earlier profile is replaced
    assert "per module" in (tmp_path / "profile.txt").read_text()
    profiler.end_profile()
    assert profiler.get_total_flops() == 0


def test_hostile_arguments_are_named_and_nothing_is_overwritten(tmp_path):
    model = nn.Linear(4, 4)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"precious")
    with pytest.raises(FileExistsError, match="not an earlier profile; not overwritten"):
        get_model_profile(model, input_shape=(2, 4), output_file=str(weights))
    assert weights.read_bytes() == b"precious"
    (tmp_path / "link").symlink_to(weights)
    with pytest.raises(ValueError, match="not a regular file"):
        get_model_profile(model, input_shape=(2, 4), output_file=str(tmp_path / "link"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        get_model_profile(model, input_shape=(2, 4), output_file=str(tmp_path / "missing" / "p.txt"))
    for kwargs, message in (
        ({"module_depth": -2}, "module_depth"),
        ({"top_modules": 0}, "top_modules"),
        ({"warm_up": -1}, "warm_up"),
        ({"mode": "backward"}, "mode"),
    ):
        with pytest.raises(ValueError, match=message):
            get_model_profile(model, input_shape=(2, 4), **kwargs)
    with pytest.raises(ValueError, match="input_shape"):
        get_model_profile(model, input_shape=(2, float("nan")))
    with pytest.raises(ValueError, match="not both"):
        get_model_profile(model, input_shape=(2, 4), args=[torch.ones(2, 4)])
    with pytest.raises(TypeError, match="nn.Module"):
        FlopsProfiler("model")
    with pytest.raises(ValueError, match="recompute_fwd_factor"):
        FlopsProfiler(model, recompute_fwd_factor=float("nan"))
