import pytest

from zeroshard.comm.backend import init_distributed


def test_a_backend_this_machine_lacks_is_named_with_those_it_has():
    """deepspeed.init_distributed(dist_backend="nccl") on a CPU-only install once failed deep in torch."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine has NCCL")
    with pytest.raises(ValueError, match=r"dist_backend 'nccl' is not available on this machine.*available: gloo"):
        init_distributed(dist_backend="nccl")
    with pytest.raises(ValueError, match=r"'cpu:gloo,cuda:nccl' is not available"):
        init_distributed(dist_backend="cpu:gloo,cuda:nccl")
