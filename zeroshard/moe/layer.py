"""DeepSpeed's MoE layer (``deepspeed.moe.layer.MoE``): a capacity-gated mixture of copies of one expert module,
its experts split over an expert-parallel group, with DeepSpeed's constructor, forward and parameter names (so
state dicts and client code that reach into ``deepspeed_moe.gate.wg`` or ``deepspeed_moe.experts.deepspeed_experts``
keep working).

The gate (``gating.py``) decides, per token, its experts and weights and which choices fit the capacity; the kept
rows travel to the ranks of their experts and back (``ExpertDispatch``: only real rows, where DeepSpeed sends
capacity-sized padded buffers; the outputs are the same), each local expert runs on its rows, and each token's
output is the weighted sum of its kept choices (a token whose choices were all dropped comes out zero, as in
DeepSpeed). The experts are ``num_experts / ep_size`` deep copies of ``expert`` (rank ``r``'s copy ``i`` is expert
``r * L + i``), tagged with DeepSpeed's expert-parameter protocol (``allreduce = False``, ``group_name``).

The layer does not own its expert group: ``initialize`` builds the mesh from the layers' ``ep_size`` and hands each
layer its group (``use_expert_group``), as DeepSpeed's engine calls ``set_deepspeed_parallelism``. With
``ep_size`` 1 the layer runs on its own.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.nn.functional as F

from .. import comm
from .dispatch import ExpertDispatch
from .gating import NOISY_GATE_POLICIES, Gated, jitter, top1, top2


class TopKGate(torch.nn.Module):
    """The router: ``wg`` (``hidden -> experts``, fp32 as DeepSpeed keeps it) and the top-k capacity gate."""

    def __init__(
        self,
        model_dim: int,
        num_experts: int,
        k: int,
        capacity_factor: float,
        eval_capacity_factor: float,
        min_capacity: int,
        noisy_gate_policy: Optional[str],
        drop_tokens: bool,
        use_rts: bool,
        second_expert_sampling: bool,
    ):
        super().__init__()
        self.wg = torch.nn.Linear(model_dim, num_experts, bias=False).float()
        self.k, self.capacity_factor, self.eval_capacity_factor = k, capacity_factor, eval_capacity_factor
        self.min_capacity, self.noisy_gate_policy, self.drop_tokens = min_capacity, noisy_gate_policy, drop_tokens
        self.use_rts, self.second_expert_sampling = use_rts, second_expert_sampling

    def forward(self, tokens: torch.Tensor, used_token: Optional[torch.Tensor] = None) -> Gated:
        x = tokens.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x = jitter(x)
        logits = F.linear(x, self.wg.weight.float())
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            noise = self.noisy_gate_policy if self.training else None
            return top1(logits, factor, self.min_capacity, used_token, noise, self.drop_tokens, self.use_rts)
        return top2(logits, factor, self.min_capacity, self.drop_tokens, self.second_expert_sampling)


class Experts(torch.nn.Module):
    """This rank's experts: ``deepspeed_experts``, deep copies of one module, tagged as expert parameters."""

    def __init__(self, expert: torch.nn.Module, num_local_experts: int, expert_group_name: str):
        super().__init__()
        self.deepspeed_experts = torch.nn.ModuleList([copy.deepcopy(expert) for _ in range(num_local_experts)])
        self.num_local_experts = num_local_experts
        for param in self.deepspeed_experts.parameters():
            param.allreduce, param.group_name = False, expert_group_name

    def forward(self, rows: torch.Tensor, per_expert: list[int]) -> torch.Tensor:
        outputs = []
        for expert, chunk in zip(self.deepspeed_experts, rows.split(per_expert)):
            out = expert(chunk)
            outputs.append(out[0] if isinstance(out, tuple) else out)  # a (output, bias) expert: the output
        return torch.cat(outputs)


class MOELayer(torch.nn.Module):
    """Gate, token exchange, experts; keeps the last forward's ``l_aux`` and ``exp_counts`` (DeepSpeed's)."""

    def __init__(self, gate: TopKGate, experts: Experts, ep_group_name: str, ep_size: int, num_local_experts: int):
        super().__init__()
        self.gate, self.experts = gate, experts
        self.ep_group_name, self.ep_size, self.num_local_experts = ep_group_name, ep_size, num_local_experts
        self.num_experts = ep_size * num_local_experts
        self.dispatch: Optional[ExpertDispatch] = None  # over the expert group initialize hands it
        self.l_aux: Optional[torch.Tensor] = None
        self.exp_counts: Optional[torch.Tensor] = None

    def use_expert_group(self, group: comm.Group) -> None:
        if group.size != self.ep_size:
            raise ValueError(f"an MoE layer with ep_size {self.ep_size} was given an expert group of {group.size}")
        self.dispatch = ExpertDispatch(group, self.num_experts)

    def forward(self, hidden: torch.Tensor, used_token: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.dispatch is None:
            if self.ep_size > 1:
                raise RuntimeError(
                    f"this MoE layer splits its experts over {self.ep_size} ranks ({self.ep_group_name}): build the "
                    "engine first (deepspeed.initialize / zeroshard.initialize hands it its expert group)"
                )
            self.use_expert_group(comm.solo_group("expert"))
        tokens = hidden.reshape(-1, hidden.shape[-1])
        gated = self.gate(tokens, used_token)
        self.l_aux, self.exp_counts = gated.aux_loss, gated.counts
        rows, per_expert, dispatched = self.dispatch.send(tokens, gated.experts, gated.kept)
        out = self.dispatch.combine(self.experts(rows, per_expert), gated.weights, dispatched)
        return out.reshape(hidden.shape)


class MoE(torch.nn.Module):
    """DeepSpeed's ``MoE(hidden_size, expert, num_experts, ep_size, k, capacity_factor, eval_capacity_factor,
    min_capacity, use_residual, noisy_gate_policy, drop_tokens, use_rts, use_tutel,
    enable_expert_tensor_parallelism, top2_2nd_expert_sampling)``; ``forward(hidden_states, used_token=None)``
    returns ``(output, l_aux, exp_counts)``. ``use_residual``: Residual MoE (the output mixed with ``expert``
    itself by a learned 2-way softmax, ``coefficient``)."""

    def __init__(
        self,
        hidden_size: int,
        expert: torch.nn.Module,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        use_residual: bool = False,
        noisy_gate_policy: Optional[str] = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        use_tutel: bool = False,
        enable_expert_tensor_parallelism: bool = False,
        top2_2nd_expert_sampling: bool = True,
    ):
        super().__init__()
        for name, value in (("num_experts", num_experts), ("ep_size", ep_size), ("hidden_size", hidden_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MoE: {name} must be a positive int, got {value!r}")
        if num_experts % ep_size:
            raise ValueError(f"MoE: num_experts {num_experts} must be divisible by ep_size {ep_size}")
        if k not in (1, 2):
            raise NotImplementedError(
                f"MoE: k={k!r}: top-1 and top-2 gating are implemented (DeepSpeed's topk beyond 2 is not)"
            )
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(
                f"MoE: noisy_gate_policy must be one of {list(NOISY_GATE_POLICIES)}, got {noisy_gate_policy!r}"
            )
        if enable_expert_tensor_parallelism:
            raise NotImplementedError("MoE: enable_expert_tensor_parallelism=True (tensor parallelism inside experts)")
        for name, value in (("capacity_factor", capacity_factor), ("eval_capacity_factor", eval_capacity_factor)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"MoE: {name} must be a positive finite number, got {value!r}")
        self.use_residual, self.ep_size, self.num_experts = use_residual, ep_size, num_experts
        self.use_tutel = use_tutel  # a kernel choice (Tutel's fast dispatch): the outputs are the same
        self.expert_group_name = f"ep_size_{ep_size}"
        self.num_local_experts = num_experts // ep_size
        gate = TopKGate(
            hidden_size,
            num_experts,
            k,
            capacity_factor,
            eval_capacity_factor,
            min_capacity,
            noisy_gate_policy,
            drop_tokens,
            use_rts,
            top2_2nd_expert_sampling,
        )
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        self.deepspeed_moe = MOELayer(gate, experts, self.expert_group_name, ep_size, self.num_local_experts)
        if use_residual:
            self.mlp = expert
            self.coefficient = torch.nn.Linear(hidden_size, 2)

    def forward(self, hidden_states: torch.Tensor, used_token: Optional[torch.Tensor] = None):
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            residual = self.mlp(hidden_states)
            residual = residual[0] if isinstance(residual, tuple) else residual
            mix = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * mix[..., 0:1] + residual * mix[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts


def moe_layers(model: torch.nn.Module) -> list[MOELayer]:
    """The DeepSpeed-style MoE layers of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, MOELayer)]


def expert_names(model: torch.nn.Module, ep_size: int) -> dict[str, tuple[str, ...]]:
    """Each local expert parameter of the model's MoE layers (by name) -> its name under the global expert index on
    each of ``ep_size`` expert ranks (rank ``r``'s copy ``i`` is expert ``r * L + i``): how a checkpoint and the
    consolidated weights name every expert. {} with ``ep_size`` 1, where the local names are the global ones."""
    if ep_size == 1:
        return {}
    names = {}
    for path, module in model.named_modules():
        if not isinstance(module, Experts):
            continue
        prefix = f"{path}.deepspeed_experts" if path else "deepspeed_experts"
        local = module.num_local_experts
        for i, expert in enumerate(module.deepspeed_experts):
            for rest, _ in expert.named_parameters():
                names[f"{prefix}.{i}.{rest}"] = tuple(f"{prefix}.{r * local + i}.{rest}" for r in range(ep_size))
    return names
