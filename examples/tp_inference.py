"""Serve a Hugging Face causal LM with tensor parallelism: each rank holds 1/N of the weights.

    zeroshard --num_gpus 2 examples/tp_inference.py                       # random-weight GPT-2 config
    zeroshard --num_gpus 2 examples/tp_inference.py --checkpoint DIR      # HF directory or zeroshard checkpoint

With ``--checkpoint`` the model is built on the meta device and every rank reads only its own
slices. Prints the parameter bytes per rank, prefill latency, generation tokens/s and the generated ids
(identical on every rank).
"""

import argparse
import time

import torch
import transformers

import zeroshard
from zeroshard import comm


def build(args) -> torch.nn.Module:
    if args.model == "llama":
        config = transformers.LlamaConfig(
            num_hidden_layers=args.n_layer,
            hidden_size=args.n_embd,
            intermediate_size=4 * args.n_embd,
            num_attention_heads=args.n_head,
            num_key_value_heads=max(args.n_head // 2, 1),
            vocab_size=args.vocab,
        )
        cls = transformers.LlamaForCausalLM
    else:
        config = transformers.GPT2Config(
            n_layer=args.n_layer,
            n_embd=args.n_embd,
            n_head=args.n_head,
            vocab_size=args.vocab,
            n_positions=1024,
            bos_token_id=args.vocab - 1,
            eos_token_id=args.vocab - 1,
        )
        cls = transformers.GPT2LMHeadModel
    torch.manual_seed(args.seed)
    if args.checkpoint:
        with zeroshard.init_empty_weights():
            return cls(config)
    return cls(config)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["gpt2", "llama"], default="gpt2")
    parser.add_argument(
        "--checkpoint", default=None, help="HF checkpoint directory, safetensors file or zeroshard checkpoint"
    )
    parser.add_argument("--tp_size", type=int, default=None, help="default: every launched rank")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--n_layer", type=int, default=4)
    parser.add_argument("--n_embd", type=int, default=256)
    parser.add_argument("--n_head", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--prompt_len", type=int, default=32)
    parser.add_argument("--new_tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    comm.init_distributed()
    rank, world = comm.get_rank(), comm.get_world_size()
    engine = zeroshard.init_inference(
        build(args), tensor_parallel={"tp_size": args.tp_size or world}, dtype=args.dtype, checkpoint=args.checkpoint
    )
    prompt = torch.randint(0, args.vocab, (1, args.prompt_len), generator=torch.Generator().manual_seed(args.seed))

    engine(prompt)  # warm-up
    started = time.perf_counter()
    engine(prompt)
    prefill = time.perf_counter() - started
    started = time.perf_counter()
    new = args.new_tokens
    ids = engine.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    decode = time.perf_counter() - started

    # every rank's parameter bytes and generated ids, gathered with one all-reduce of a slot per rank
    stats = torch.zeros(world, 1 + ids.shape[1], dtype=torch.float64)
    stats[rank, 0] = engine.parameter_bytes()
    stats[rank, 1:] = ids[0].double()
    comm.all_reduce(stats, comm.Group("world", tuple(range(world)), None))
    if rank == 0:
        print(f"tp_size {engine.group.size}, {args.model} with {args.n_layer} layers, width {args.n_embd}")
        print("parameter MiB per rank: " + ", ".join(f"{b / 2**20:.1f}" for b in stats[:, 0].tolist()))
        print(f"prefill {args.prompt_len} tokens: {prefill * 1e3:.0f} ms")
        print(f"generate {args.new_tokens} tokens: {args.new_tokens / decode:.1f} tokens/s (greedy, KV cache)")
        same = all(torch.equal(stats[r, 1:], stats[0, 1:]) for r in range(world))
        print(f"generated ids (identical on all ranks: {same}): {ids[0, args.prompt_len :].tolist()}")


if __name__ == "__main__":
    main()
