"""DeepSpeed compatibility mode end to end: unmodified DeepSpeed-style and Hugging Face scripts under
`zeroshard --as_deepspeed` on 2 CPU ranks (real transformers / accelerate classes, real processes)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "distributed" / "scripts" / "compat"


def launch(*argv, timeout=300, env=None):
    out = subprocess.run(
        [sys.executable, "-m", "zeroshard", "--as_deepspeed", "--num_gpus", "2", *map(str, argv)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-8000:]
    return out


def result(out) -> dict:
    line = next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


@pytest.mark.parametrize("stage", [2, 3])
def test_hf_trainer_trains_saves_and_resumes(tmp_path, stage):
    first = result(launch(SCRIPTS / "hf_trainer.py", tmp_path, stage))
    assert first["global_step"] == 4 and len(first["losses"]) == 4
    saved = load_file(tmp_path / "final" / "model.safetensors")
    gathered = torch.load(tmp_path / "final" / "gathered.pt")
    assert saved.keys() <= gathered.keys() and len(saved) > 10
    assert all(torch.equal(saved[k], gathered[k]) for k in saved)  # save_model wrote the gathered weights

    resumed = result(launch(SCRIPTS / "hf_trainer.py", tmp_path, stage, "--resume"))
    assert resumed["global_step"] == 4
    assert resumed["losses"] == first["losses"]  # steps 3-4 after resuming from checkpoint-2 match the full run
    again = load_file(tmp_path / "final-resumed" / "model.safetensors")
    assert all(torch.equal(again[k], saved[k]) for k in saved)


def test_hf_zero3_from_pretrained_loads_every_weight(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=16, bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(config).save_pretrained(tmp_path)
    out = launch(SCRIPTS / "hf_zero3_from_pretrained.py", tmp_path)
    assert "differing: []" in out.stdout and "compared 28 tensors" in out.stdout
