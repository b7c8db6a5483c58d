"""On a CUDA device (skipped without one): stages 0-3, bf16 and fp32, CPU and NVMe offload with pinned
memory, on NCCL with one rank per GPU, against the single-process fp32 reference."""

import pytest
import torch

from zeroshard.testing import run_distributed
from zeroshard.testing.parity import ParityCase, engine_train_many, model_error, reference_train

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
UNITS = (("gather_unit_classes", ["Block"]), ("stage3_param_persistence_threshold", 0))
OFFLOAD = (
    ("offload_optimizer", {"device": "cpu", "pin_memory": True}),
    ("offload_param", {"device": "nvme", "nvme_path": "/tmp", "max_in_cpu": 0, "pin_memory": True}),
    ("sub_group_size", 1000),
)
CASES = [ParityCase(stage=s, gas=2, lr=1e-3, zero=UNITS if s == 3 else ()) for s in (0, 1, 2, 3)]
CASES += [ParityCase(stage=s, gas=2, lr=1e-3, dtype="bf16", zero=UNITS if s == 3 else ()) for s in (2, 3)]
CASES += [ParityCase(stage=3, gas=2, lr=1e-3, zero=UNITS + OFFLOAD)]


def test_cuda_parity():
    world = min(torch.cuda.device_count(), 2)
    results = run_distributed(engine_train_many, world, CASES, env={"ZEROSHARD_ACCELERATOR": "cuda"})[0]
    for case, result in zip(CASES, results):
        bound = 1e-5 if case.dtype == "fp32" else 1e-2  # the reference runs on the CPU in fp32
        assert model_error(result["params"], reference_train(case, world)) <= bound, case


def tp_worker() -> dict:
    import zeroshard
    from tests.distributed.test_inference import hf_model, prompts

    ids = prompts()
    expected = hf_model("llama")(ids).logits  # on the CPU
    engine = zeroshard.init_inference(
        hf_model("llama"), tensor_parallel={"tp_size": torch.distributed.get_world_size()}
    )
    logits = engine(ids).logits
    return {"device": str(logits.device), "error": (logits.cpu() - expected).abs().max().item()}


def test_cuda_tensor_parallel_inference():
    world = min(torch.cuda.device_count(), 2)
    r = run_distributed(tp_worker, world, env={"ZEROSHARD_ACCELERATOR": "cuda"})[0]
    assert r["device"].startswith("cuda") and r["error"] <= 1e-4
