"""Structural rules of the package, enforced: the comm layer owns torch.distributed; the public API is stable."""

import re
from pathlib import Path

import zeroshard

PACKAGE = Path(zeroshard.__file__).parent
DIST_IMPORT = re.compile(r"^\s*(import torch\.distributed|from torch\.distributed|from torch import distributed)", re.M)


def test_only_comm_imports_torch_distributed():
    offenders = [
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if DIST_IMPORT.search(p.read_text()) and p.relative_to(PACKAGE).parts[0] != "comm"
    ]
    assert offenders == []


def test_no_bare_asserts_in_library_code():
    offenders = [
        str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if re.search(r"^\s*assert\s", p.read_text(), re.M)
    ]
    assert offenders == []


def test_public_api_surface():
    assert set(zeroshard.__all__) >= {
        "initialize",
        "add_config_arguments",
        "init_distributed",
        "comm",
        "init_inference",
    }
    assert callable(zeroshard.comm.log_summary)
    engine_api = {
        "backward",
        "step",
        "is_gradient_accumulation_boundary",
        "zero_grad",
        "was_step_applied",
        "get_lr",
        "get_global_grad_norm",
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "zero_optimization_stage",
        "destroy",
        "save_checkpoint",
        "load_checkpoint",
        "train",
        "eval",
    }
    assert engine_api <= set(dir(zeroshard.ZeroshardEngine))


def test_add_config_arguments():
    import argparse

    parser = zeroshard.add_config_arguments(argparse.ArgumentParser())
    assert parser.parse_args(["--deepspeed", "--deepspeed_config", "a.json"]).deepspeed_config == "a.json"
    args = parser.parse_args(["--zeroshard", "--zeroshard_config", "b.json"])
    assert args.deepspeed and args.deepspeed_config == "b.json"
