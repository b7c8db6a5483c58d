"""``zeroshard [--num_gpus N] script.py [args]``: start N local ranks through torch's elastic agent.

The agent (``torch.distributed.run``, i.e. torchrun) sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* for
each rank, and when one rank fails it stops the others and exits non-zero, naming the failed rank.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from typing import Optional, Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zeroshard",
        description="Launch a training script on N local processes (GPUs with NCCL, else CPU with Gloo).",
    )
    count = parser.add_mutually_exclusive_group()
    count.add_argument(
        "--num_gpus",
        "--num_procs",
        type=int,
        default=None,
        help="processes to start on this node (default: the number of GPUs, or 1 without GPUs)",
    )
    count.add_argument("--nproc_per_node", type=int, default=None, help="same as --num_gpus (torchrun's name)")
    parser.add_argument("--num_nodes", type=int, default=1, help="only 1 is supported by this launcher so far")
    parser.add_argument("--master_addr", default="127.0.0.1", help="rendezvous address (default 127.0.0.1)")
    parser.add_argument(
        "--master_port", type=int, default=None, help="rendezvous port (default: a free port chosen by the agent)"
    )
    parser.add_argument("--module", "-m", action="store_true", help="run the script as a Python module (python -m)")
    parser.add_argument("--max_restarts", type=int, default=0, help="restarts of the whole group after a failure")
    parser.add_argument(
        "--as_deepspeed",
        action="store_true",
        help="serve `import deepspeed` from zeroshard in every rank, so an unmodified DeepSpeed / Hugging Face / "
        "Accelerate script runs on zeroshard (see zeroshard.install_as_deepspeed)",
    )
    parser.add_argument("script", help="the training script (or module with --module)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    return parser


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


def check_process_count(nprocs: int, gpus: int, cores: int) -> Optional[str]:
    """Refuse more ranks than GPUs (two ranks on one GPU fail late, in NCCL); without GPUs, warn when the ranks
    outnumber the CPU cores. Returns the warning, if any (pure: counts in, verdict out)."""
    if nprocs < 1:
        raise SystemExit(f"zeroshard: --num_gpus must be >= 1, got {nprocs}")
    if gpus and nprocs > gpus:
        raise SystemExit(
            f"zeroshard: --num_gpus {nprocs} but this machine has {gpus} GPU(s); start at most {gpus} ranks "
            "(or hide the GPUs with CUDA_VISIBLE_DEVICES= to run on the CPU)"
        )
    if not gpus and nprocs > cores:
        return (
            f"zeroshard: warning: {nprocs} CPU ranks on {cores} core(s): the ranks share cores and every "
            "collective waits for the slowest; expect each rank to run about "
            f"{nprocs / cores:.1f}x slower than alone"
        )
    return None


def torchrun_command(args: argparse.Namespace) -> list[str]:
    requested = args.num_gpus if args.num_gpus is not None else args.nproc_per_node
    gpus = _gpu_count()
    nprocs = max(gpus, 1) if requested is None else requested
    warning = check_process_count(nprocs, gpus, os.cpu_count() or 1)
    if warning:
        print(warning, file=sys.stderr)
    if args.num_nodes != 1:
        raise SystemExit("zeroshard: multi-node launch (--num_nodes > 1) is not supported yet; use one node")
    if not args.module and not os.path.isfile(args.script):
        raise SystemExit(f"zeroshard: script '{args.script}' does not exist")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nprocs}",
        f"--max_restarts={args.max_restarts}",
    ]
    if args.master_port is None:
        cmd.append("--standalone")
    else:
        cmd += ["--nnodes=1", "--node_rank=0", f"--master_addr={args.master_addr}", f"--master_port={args.master_port}"]
    if args.as_deepspeed:  # every rank starts in the runner, which installs the alias before the script runs
        cmd.append("--module")
        return cmd + ["zeroshard.compat.run", *(["-m"] if args.module else []), args.script, *args.script_args]
    if args.module:
        cmd.append("--module")
    return cmd + [args.script, *args.script_args]


def convert_main(argv: Sequence[str]) -> int:
    """``zeroshard convert CKPT_DIR OUT [--tag T] [--max_shard_size 5GB] [--no_progress]``."""
    parser = argparse.ArgumentParser(
        prog="zeroshard convert", description="Write a checkpoint's fp32 weights as safetensors (streaming)."
    )
    parser.add_argument("checkpoint_dir")
    parser.add_argument("output", help="a .safetensors file, or a directory for (sharded) HF-style files")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: the one in 'latest')")
    parser.add_argument("--max_shard_size", default="5GB")
    parser.add_argument("--no_progress", action="store_true", help="no progress bar (on stderr)")
    args = parser.parse_args(argv)
    from ..checkpoint import CheckpointError, convert_zero_checkpoint_to_fp32_state_dict

    try:
        files = convert_zero_checkpoint_to_fp32_state_dict(
            args.checkpoint_dir,
            args.output,
            tag=args.tag,
            max_shard_size=args.max_shard_size,
            progress=not args.no_progress,
        )
    except (CheckpointError, ValueError) as err:
        print(f"zeroshard convert: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"zeroshard convert: cannot write {err.filename or args.output}: {err.strerror or err}", file=sys.stderr)
        return 2
    for path in files:
        print(path)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["convert"]:
        return convert_main(argv[1:])
    args = build_parser().parse_args(argv)
    cmd = torchrun_command(args)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # N ranks on one host: avoid N x cores threads
    if args.as_deepspeed:
        env["ZEROSHARD_AS_DEEPSPEED"] = "1"
    return run_agent(cmd, env)


def run_agent(cmd: list[str], env: dict[str, str]) -> int:
    """Run the elastic agent; SIGTERM or SIGINT sent to this launcher is passed on to the agent, which stops
    every rank (it would otherwise keep training as an orphan). The exit code is then 128 + the signal's
    number, as a shell reports a process ended by that signal."""
    agent = subprocess.Popen(cmd, env=env)
    received: list[int] = []

    def forward(signum, frame):
        received.append(signum)
        if agent.poll() is None:
            agent.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = agent.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received:
        return 128 + received[0]
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
