"""``deepspeed.git_version_info``: the DeepSpeed API version zeroshard serves, and its (absent) compiled ops."""

import torch

from zeroshard.accelerator import get_accelerator

from ..alias import DEEPSPEED_API_VERSION

version = DEEPSPEED_API_VERSION
git_hash = "[zeroshard]"
git_branch = "[zeroshard]"
# DeepSpeed's ops by name: true for those zeroshard serves without building anything (its optimizers are torch's
# kernels), false for DeepSpeed's compiled kernels, which it does not have (its NVMe offload is its own I/O)
SERVED_OPS = ("cpu_adam", "fused_adam", "cpu_adagrad", "cpu_lion", "fused_lion")
KERNEL_OPS = ("async_io", "gds", "evoformer_attn", "sparse_attn", "transformer", "transformer_inference", "quantizer")
installed_ops: dict[str, bool] = {**dict.fromkeys(KERNEL_OPS, False), **dict.fromkeys(SERVED_OPS, True)}
compatible_ops: dict[str, bool] = dict(installed_ops)
accelerator_name = get_accelerator().device().type
torch_info = {
    "version": ".".join(torch.__version__.split("+")[0].split(".")[:2]),
    "cuda_version": torch.version.cuda or "0.0",
    "nccl_version": ".".join(map(str, torch.cuda.nccl.version()[:2])) if torch.cuda.is_available() else "0.0",
    "hip_version": torch.version.hip or "0.0",
}

__all__ = ["accelerator_name", "compatible_ops", "git_branch", "git_hash", "installed_ops", "torch_info", "version"]
