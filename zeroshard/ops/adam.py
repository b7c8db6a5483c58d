"""CPU Adam without a compiler: torch's fused (vectorized, multi-threaded) CPU Adam kernel behind
DeepSpeed's ``DeepSpeedCPUAdam`` interface, so scripts that construct it keep working."""

from __future__ import annotations

import torch


class CPUAdam(torch.optim.AdamW):
    """Adam with decoupled weight decay (``adamw_mode=True``, the default) or L2 (``adamw_mode=False``),
    using ``torch.optim`` 's fused kernel; DeepSpeed's argument names."""

    def __init__(
        self,
        params=None,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
        *,
        model_params=None,
    ):
        """``params`` is torch's name for the first argument (LightningCLI fills it); ``model_params`` DeepSpeed's."""
        if (params is None) == (model_params is None):
            raise TypeError("CPUAdam takes the parameters once: params=... (or DeepSpeed's model_params=...)")
        if not bias_correction:
            raise NotImplementedError("CPUAdam(bias_correction=False) is not supported")
        if not fp32_optimizer_states:
            raise NotImplementedError("CPUAdam keeps fp32 optimizer states")
        super().__init__(
            params if params is not None else model_params,
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            fused=True,
        )
        self.adamw_mode = adamw_mode
        for group in self.param_groups:
            group["decoupled_weight_decay"] = adamw_mode  # False: weight decay added to the gradient (L2)


DeepSpeedCPUAdam = CPUAdam


class FusedAdam(torch.optim.AdamW):
    """DeepSpeed's ``FusedAdam`` (Adam with decoupled weight decay by default) as torch's fused Adam kernel, which
    needs no build step. ``set_grad_none`` is accepted for compatibility (gradients are always set to None)."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ):
        if not bias_correction:
            raise NotImplementedError("FusedAdam(bias_correction=False) is not supported")
        super().__init__(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)
        for group in self.param_groups:
            group["decoupled_weight_decay"] = adam_w_mode
