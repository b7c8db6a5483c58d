"""Expert parallelism against data parallelism with replicated experts on the same ranks: EP=2 vs DP=2, a small
Mixtral (transformers' own model, fused experts; AutoEP), and a small MoE GPT built on DeepSpeed's MoE layer, where
DeepSpeed 0.19.8's own layer and engine join the turns when it can be imported.

    python benchmarks/moe.py [--hidden 256] [--experts 8] [--layers 4] [--steps 12] [--micro 4] [--stage 1]
    PYTHONPATH=/tmp/dsenv DS_ACCELERATOR=cpu python benchmarks/moe.py --layer_only   # with DeepSpeed beside

Both systems train the same model from the same seed on the same micro-batches (each rank its own), ZeRO at
``--stage``, taking turns step by step in one process group so machine noise hits both alike. EP=2: each rank holds
half of every layer's experts (``expert_parallel.autoep_size 2``) and sends each token to the rank of its experts
(two uneven all-to-alls forward, two backward, after an exchange of E counts); DP=2: every rank holds every expert
and ZeRO shards them like any parameter. Per system: median step time, bytes each rank sends per step (the engine's
ledger; the all-to-all's share apart), model-state bytes per rank (``state_bytes``), final loss (both must agree).

EP trades token traffic for expert state: the all-to-alls move ``2 x 2 x tokens x k x hidden`` elements a step
(half of them stay on the rank at EP=2 when routing is even), where DP's ZeRO moves every expert's gradient (and,
at stage 3, its weights) every step; in exchange a rank holds half of the experts' weights, gradients and state.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from zeroshard.testing import run_distributed


def model(args):
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=512,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_local_experts=args.experts,
        num_experts_per_tok=2,
        max_position_embeddings=args.seq,
        attn_implementation=getattr(args, "attn_implementation", "sdpa"),
    )
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config)


def system(args, ep: int):
    import zeroshard

    config = {
        "train_micro_batch_size_per_gpu": args.micro,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": args.stage},
        "expert_parallel": {"enabled": ep > 1, "autoep_size": ep},
    }
    engine, *_ = zeroshard.initialize(model=model(args), config=config)
    return engine


def worker(args) -> dict:
    from zeroshard import comm

    systems = {"DP=2 (experts replicated)": system(args, 1), "EP=2": system(args, 2)}
    gen = torch.Generator().manual_seed(1000 + comm.get_rank())
    data = torch.randint(0, 512, (args.steps, args.micro, args.seq), generator=gen)
    times = {name: [] for name in systems}
    wire = {name: [] for name in systems}
    token_wire = {name: [] for name in systems}
    losses = {}
    for step in range(args.steps):
        for name, engine in systems.items():
            engine.comm_ledger.reset()
            comm.barrier(engine.mesh.world)
            start = time.perf_counter()
            loss = engine(input_ids=data[step], labels=data[step]).loss
            engine.backward(loss)
            engine.step()
            times[name].append(time.perf_counter() - start)
            ledger = engine.comm_ledger.summary()
            wire[name].append(sum(t.wire_bytes for t in ledger.values()))
            token_wire[name].append(sum(t.wire_bytes for (op, _), t in ledger.items() if op == "all_to_all"))
            losses[name] = loss.item()
    out = {}
    for name, engine in systems.items():
        state = engine.state_bytes()
        state["master"] -= engine.stack.optimizer_state.master_bytes_shared_with_params()  # fp32: master = params
        out[name] = {
            "ms": 1000 * statistics.median(times[name][2:]),
            "wire": statistics.median(wire[name][2:]),
            "tokens": statistics.median(token_wire[name][2:]),
            "state": sum(state.values()) - state["idle_buffers"] - state["staging"] - state["gathered"],
            "loss": losses[name],
        }
    return out


class MoEBlock(torch.nn.Module):
    """A pre-norm transformer block whose MLP is an MoE layer of ``moe_class`` (DeepSpeed's or zeroshard's: same
    constructor, same parameter names), top-2, capacity factor 1.0."""

    def __init__(self, moe_class, width: int, experts: int, ep_size: int):
        super().__init__()
        self.ln_1, self.ln_2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.attn = torch.nn.MultiheadAttention(width, 8, batch_first=True)
        mlp = torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.GELU(), torch.nn.Linear(2 * width, width))
        self.moe = moe_class(width, mlp, num_experts=experts, ep_size=ep_size, k=2, top2_2nd_expert_sampling=False)

    def forward(self, x):
        h = self.ln_1(x)
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        out, l_aux, _ = self.moe(self.ln_2(x))
        return x + out, l_aux


class MoEGPT(torch.nn.Module):
    def __init__(self, moe_class, args, ep_size: int):
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(512, args.hidden), torch.nn.Embedding(args.seq, args.hidden)
        self.blocks = torch.nn.ModuleList(
            MoEBlock(moe_class, args.hidden, args.experts, ep_size) for _ in range(args.layers)
        )
        self.head = torch.nn.Linear(args.hidden, 512, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        aux = 0.0
        for block in self.blocks:
            x, l_aux = block(x)
            aux = aux + l_aux
        logits = self.head(x[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 512), idx[:, 1:].reshape(-1)) + 0.01 * aux


def layer_systems(args) -> dict:
    """zeroshard DP=2 (ep_size 1), zeroshard EP=2, and DeepSpeed EP=2 when real DeepSpeed imports: the same MoE GPT,
    the same initial weights (loaded by name: the layers name their parameters alike)."""
    import zeroshard
    from zeroshard import comm
    from zeroshard.moe import MoE

    torch.manual_seed(0)
    whole = MoEGPT(MoE, args, 1).state_dict()

    def local(ep: int) -> dict:
        per, ep_rank = args.experts // ep, comm.get_rank() % ep
        out = {}
        for name, value in whole.items():
            if "deepspeed_experts." not in name:
                out[name] = value
                continue
            head, tail = name.split("deepspeed_experts.")
            index, rest = tail.split(".", 1)
            if ep_rank * per <= int(index) < (ep_rank + 1) * per:
                out[f"{head}deepspeed_experts.{int(index) - ep_rank * per}.{rest}"] = value
        return out

    config = {
        "train_micro_batch_size_per_gpu": args.micro,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": min(args.stage, 2)},  # DeepSpeed's MoE runs at stages 0-2
    }
    systems = {}
    for name, ep in (("zeroshard DP=2 (experts replicated)", 1), ("zeroshard EP=2", 2)):
        model = MoEGPT(MoE, args, ep)
        model.load_state_dict(local(ep))
        systems[name] = zeroshard.initialize(model=model, config=config)[0]
    try:
        import deepspeed
        from deepspeed.moe.layer import MoE as DeepSpeedMoE
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    except ImportError:
        return systems
    model = MoEGPT(DeepSpeedMoE, args, 2)
    model.load_state_dict(local(2))
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "p"})
    systems["DeepSpeed 0.19.8 EP=2"] = deepspeed.initialize(model=model, model_parameters=groups, config=config)[0]
    return systems


def layer_worker(args) -> dict:
    from zeroshard import comm

    systems = layer_systems(args)
    gen = torch.Generator().manual_seed(1000 + comm.get_rank())
    data = torch.randint(0, 512, (args.steps, args.micro, args.seq), generator=gen)
    times, wire, losses = {n: [] for n in systems}, {n: [] for n in systems}, {}
    for step in range(args.steps):
        for name, engine in systems.items():
            ours = hasattr(engine, "comm_ledger")
            if ours:
                engine.comm_ledger.reset()
            comm.barrier(comm.Group("world", tuple(range(comm.get_world_size())), None))
            start = time.perf_counter()
            loss = engine(data[step])
            engine.backward(loss)
            engine.step()
            times[name].append(time.perf_counter() - start)
            wire[name].append(sum(t.wire_bytes for t in engine.comm_ledger.summary().values()) if ours else None)
            losses[name] = loss.item()
    out = {}
    for name, engine in systems.items():
        ours = hasattr(engine, "state_bytes")
        state = engine.state_bytes() if ours else None
        if ours:
            state["master"] -= engine.stack.optimizer_state.master_bytes_shared_with_params()
        out[name] = {
            "ms": 1000 * statistics.median(times[name][2:]),
            "wire": statistics.median(wire[name][2:]) if ours else None,
            "state": sum(state.values()) - state["idle_buffers"] - state["staging"] - state["gathered"]
            if ours
            else None,
            "loss": losses[name],
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--stage", type=int, default=1)
    parser.add_argument("--layer_only", action="store_true", help="only the DeepSpeed-layer MoE GPT")
    args = parser.parse_args()
    if not args.layer_only:
        result = run_distributed(worker, 2, args, timeout_s=3600)[0]
        params = sum(p.numel() for p in model(args).parameters()) / 1e6
        print(f"Mixtral {params:.1f}M parameters, {args.experts} experts top-2, ZeRO stage {args.stage}, 2 Gloo ranks")
        print("| system | median step (ms) | wire MB/step/rank | of it, tokens | model state MB/rank | final loss |")
        print("|---|---|---|---|---|---|")
        for name, r in result.items():
            print(
                f"| {name} | {r['ms']:.1f} | {r['wire'] / 1e6:.2f} | {r['tokens'] / 1e6:.2f} | {r['state'] / 1e6:.1f} "
                f"| {r['loss']:.4f} |"
            )
    result = run_distributed(layer_worker, 2, args, timeout_s=3600, env={"DS_ACCELERATOR": "cpu"})[0]
    print(
        f"MoE GPT on DeepSpeed's layer: {args.layers} layers, width {args.hidden}, {args.experts} experts top-2, "
        f"capacity 1.0, ZeRO stage {min(args.stage, 2)}, 2 Gloo ranks"
    )
    print("| system | median step (ms) | wire MB/step/rank | model state MB/rank | final loss |")
    print("|---|---|---|---|---|")
    for name, r in result.items():
        wire = f"{r['wire'] / 1e6:.2f}" if r["wire"] is not None else "-"
        state = f"{r['state'] / 1e6:.1f}" if r["state"] is not None else "-"
        print(f"| {name} | {r['ms']:.1f} | {wire} | {state} | {r['loss']:.4f} |")


if __name__ == "__main__":
    main()
