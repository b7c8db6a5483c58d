"""Expert parallelism against data parallelism with replicated experts on the same ranks: EP=2 vs DP=2, a small
Mixtral (transformers' own model, fused experts).

    python benchmarks/moe.py [--hidden 256] [--experts 8] [--layers 4] [--steps 12] [--micro 4] [--stage 1]

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--stage", type=int, default=1)
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
