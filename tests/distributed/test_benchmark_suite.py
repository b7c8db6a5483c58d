"""The benchmark suite as a CI smoke test on a tiny GPT (no timing assertions): every system trains to the
same loss, and zeroshard's bytes on the wire and model-state bytes equal the analytic values exactly."""

import os
import sys

import pytest

BENCHMARKS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")
sys.path.insert(0, os.path.abspath(BENCHMARKS))

import suite  # noqa: E402

NAMES = ["ddp", "fsdp2", "zeroshard-0", "zeroshard-1", "zeroshard-2", "zeroshard-3"]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_suite_smoke(tmp_path, dtype):
    suite.SIZES["tiny"] = (2, 64, 128)  # 2 layers, width 64: every parameter count here is even
    # fresh=False: the ranks forked from the harness's server (no peak RSS is read here, and fresh interpreters
    # would spend 20 s importing)
    result = suite.run_size(
        "tiny", world=2, steps=3, micro=2, warmup=1, names=NAMES, alone=False, dtype=dtype, fresh=False
    )
    timing, memory, params = result["timing"], result["memory"], result["params"]
    reference = timing["ddp"]["loss"]
    for name in NAMES:
        assert abs(timing[name]["loss"] - reference) <= suite.LOSS_TOLERANCE[dtype] * abs(reference), name
        if name.startswith("zeroshard"):
            assert timing[name]["wire"] == timing[name]["analytic_wire"], name
            assert timing[name]["wire"] > 0
    # Adam after a step, stage 3: 16P/N in fp32 (4 + 4 + 8) and in bf16 (2 + 2 + fp32 master 4 + 8)
    assert memory["zeroshard-3"]["model_state"] == suite.analytic_model_state("zeroshard-3", params, 2)
    if dtype == "fp32":  # stage 2: 4P (weights) + 12P/N (gradient shard, Adam)
        assert memory["zeroshard-2"]["model_state"] == suite.analytic_model_state("zeroshard-2", params, 2)
    text = suite.report({f"tiny x 2 ranks, {dtype}": result}, NAMES, str(tmp_path))
    assert "| zeroshard-3 |" in text and "(differs!)" not in text and f", {dtype}, " in text
