"""CPU Adagrad without a compiler: torch's Adagrad (foreach kernels) behind DeepSpeed's ``DeepSpeedCPUAdagrad``
interface, which Accelerate builds in place of ``torch.optim.Adagrad`` when the optimizer state is offloaded."""

from __future__ import annotations

import torch


class CPUAdagrad(torch.optim.Adagrad):
    """Adagrad with DeepSpeed's argument names and defaults (``lr=1e-2``, ``eps=1e-10``); the update is torch's."""

    def __init__(
        self,
        model_params,
        lr: float = 1e-2,
        eps: float = 1e-10,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        fp32_optimizer_states: bool = True,
    ):
        if amsgrad:
            raise NotImplementedError("CPUAdagrad(amsgrad=True): Adagrad has no amsgrad variant (DeepSpeed's neither)")
        if not fp32_optimizer_states:
            raise NotImplementedError("CPUAdagrad keeps fp32 optimizer states")
        super().__init__(model_params, lr=lr, eps=eps, weight_decay=weight_decay, foreach=True)


DeepSpeedCPUAdagrad = CPUAdagrad

__all__ = ["CPUAdagrad", "DeepSpeedCPUAdagrad"]
