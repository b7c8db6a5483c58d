"""``zeroshard [--num_gpus N] script.py [args]``: start ranks through torch's elastic agent.

One node: N local ranks. Several nodes: ``--hostfile`` (DeepSpeed's format and filters) starts every node
through ssh, pdsh, SLURM or Open MPI, or each node starts its own launcher with ``--no_ssh --node_rank K``;
every node's agent joins a c10d rendezvous at ``--master_addr:--master_port``. The agent (``torch.distributed.run``,
i.e. torchrun) sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* for each rank, restarts the worker group after a
failure (``--max_restarts``), and when it gives up stops the others and exits non-zero, naming the failed rank.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Optional, Sequence

from ..arguments import bounded
from ..log import LEVEL_VARIABLE, log_to_stdout
from .convert import convert_main
from .hostfile import check_resource_flags, parse_hostfile, select_resources
from .multinode import (
    LAUNCHERS,
    Job,
    agent_command,
    exported_environment,
    parse_rdzv_conf,
    read_env_files,
    wait_for_master,
)

DEFAULT_MASTER_PORT = 29500


def _add_node_options(parser: argparse.ArgumentParser) -> None:
    """Which hosts run ranks, how their agents start, and where they meet (multi-node)."""
    parser.add_argument("-H", "--hostfile", default=None, help="hosts and their slots, one 'HOST slots=N' per line")
    parser.add_argument("-i", "--include", default=None, help="hosts/slots to use, e.g. 'worker-0:0,1@worker-1'")
    parser.add_argument("-e", "--exclude", default=None, help="hosts/slots to leave out, same format as --include")
    parser.add_argument(
        "--launcher",
        choices=sorted(LAUNCHERS),
        default="ssh",
        help="how the nodes of a hostfile are started (default ssh; pdsh, slurm (srun), openmpi (mpirun))",
    )
    parser.add_argument("--ssh_port", type=bounded(1, 65535), default=None, help="ssh port of the nodes")
    parser.add_argument(
        "--no_ssh",
        action="store_true",
        help="start only this node's agent (clusters that start one launcher per node); needs --node_rank",
    )
    parser.add_argument(
        "--node_rank", type=bounded(0), default=None, help="this node's rank with --no_ssh (0 is the master)"
    )
    parser.add_argument(
        "--master_addr", default=None, help="rendezvous address (default 127.0.0.1; with a hostfile its first host)"
    )
    parser.add_argument(
        "--master_port",
        type=bounded(1, 65535),
        default=None,
        help=f"rendezvous port (one node: a free port chosen by the agent; several: {DEFAULT_MASTER_PORT})",
    )
    parser.add_argument(
        "--master_timeout",
        type=float,
        default=300.0,
        help="seconds a node waits for the master's rendezvous port before it gives up (default 300)",
    )
    parser.add_argument(
        "--rdzv_conf",
        "--rdzv-conf",
        type=_rdzv_conf,
        default=(),
        help="torchrun's rendezvous options for a multi-node job, KEY=SECONDS,... (join_timeout, last_call_timeout: "
        "how long the nodes left after one leaves wait for more before going on, default 30; close_timeout, "
        "heartbeat_timeout, keep_alive_interval, keep_alive_max_attempt, read_timeout)",
    )


def _rdzv_conf(text: str) -> tuple[tuple[str, int], ...]:
    try:
        return parse_rdzv_conf(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("--rdzv_conf: ")) from None


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
    parser.add_argument("--num_nodes", type=bounded(1), default=None, help="nodes to use (the first N of the hostfile)")
    parser.add_argument(
        "--nnodes",
        default=None,
        help="torchrun's node count for the rendezvous: N, or MIN:MAX for elastic membership (default: --num_nodes)",
    )
    _add_node_options(parser)
    parser.add_argument("--module", "-m", action="store_true", help="run the script as a Python module (python -m)")
    parser.add_argument(
        "--max_restarts", type=bounded(0), default=0, help="restarts of the whole group after a failure"
    )
    parser.add_argument(
        "--as_deepspeed",
        action="store_true",
        help="serve `import deepspeed` from zeroshard in every rank, so an unmodified DeepSpeed / Hugging Face / "
        "Accelerate script runs on zeroshard (see zeroshard.install_as_deepspeed)",
    )
    parser.add_argument("script", help="the training script (or module with --module)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    return parser


# where a GPU driver shows itself on Linux: NVIDIA (also in containers), AMD ROCm, NVIDIA under WSL2
GPU_DRIVER_PATHS = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/kfd", "/dev/dxg")


def gpu_count(driver_paths: Sequence[str] = GPU_DRIVER_PATHS) -> int:
    """``torch.cuda.device_count()``. A Linux machine with none of the GPU drivers, or a Mac, has no CUDA device:
    that answer needs no torch, whose import costs the launcher 2-3 s on every launch."""
    if sys.platform == "darwin" or (
        sys.platform.startswith("linux") and not any(os.path.exists(path) for path in driver_paths)
    ):
        return 0
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


def _local_processes(args: argparse.Namespace) -> int:
    requested = args.num_gpus if args.num_gpus is not None else args.nproc_per_node
    gpus = gpu_count()
    nprocs = max(gpus, 1) if requested is None else requested
    warning = check_process_count(nprocs, gpus, os.cpu_count() or 1)
    if warning:
        print(warning, file=sys.stderr)
    if not args.module and not os.path.isfile(args.script):
        raise SystemExit(f"zeroshard: script '{args.script}' does not exist")
    return nprocs


def torchrun_command(args: argparse.Namespace) -> list[str]:
    """One node on its own: torchrun for ``--num_gpus`` local ranks."""
    if (args.num_nodes or 1) != 1:
        raise SystemExit(
            "zeroshard: a multi-node launch needs --hostfile (every node started from here), or --no_ssh "
            "--node_rank K on each node"
        )
    if args.rdzv_conf:
        raise SystemExit(
            "zeroshard: --rdzv_conf sets a multi-node job's rendezvous (--hostfile, or --no_ssh --node_rank K); one "
            "node alone waits for no other: drop it"
        )
    nprocs = _local_processes(args)
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
        addr = args.master_addr or "127.0.0.1"
        cmd += ["--nnodes=1", "--node_rank=0", f"--master_addr={addr}", f"--master_port={args.master_port}"]
    if args.as_deepspeed:  # every rank starts in the runner, which installs the alias before the script runs
        cmd.append("--module")
        return cmd + ["zeroshard.compat.run", *(["-m"] if args.module else []), args.script, *args.script_args]
    if args.module:
        cmd.append("--module")
    return cmd + [args.script, *args.script_args]


def main(argv: Optional[Sequence[str]] = None, export_prefixes: Sequence[str] = ()) -> int:
    """The ``zeroshard`` command. ``export_prefixes``: more prefixes of variables a multi-node launch exports to
    every node (DeepSpeed's ``launcher.runner.EXPORT_ENVS``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    log_to_stdout()  # the CLI prints zeroshard's lines (the library alone configures no logging)
    if argv[:1] == ["convert"]:
        return convert_main(argv[1:])
    if argv[:1] == ["estimate"]:
        from ..estimator import main as estimate_main

        return estimate_main(argv[1:])
    if argv[:1] == ["report"]:
        from ..env_report import main as report_main

        return report_main(argv[1:])
    try:
        args = launch_arguments(argv)
    except ValueError as err:
        raise SystemExit(f"zeroshard: {err}") from None
    if args.no_ssh or args.node_rank is not None:
        return run_node(args)
    if args.hostfile is not None:
        return run_hostfile(args, tuple(export_prefixes))
    return run_processes([torchrun_command(args)], _agent_env(args))


SUBCOMMANDS = ("convert", "estimate", "report")  # the first word that makes the command something else than a launch


def launch_arguments(argv: Sequence[str]) -> argparse.Namespace:
    """A launch's arguments; flags that cannot go together (DeepSpeed's rule: ``-i`` / ``-e`` with ``--num_nodes`` /
    ``--num_gpus``) are a ``ValueError`` naming them."""
    args = build_parser().parse_args(argv)
    check_resource_flags(args.include, args.exclude, args.num_nodes, args.num_gpus)
    return args


def _agent_env(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # N ranks on one host: avoid N x cores threads
    # torch 2.13's agent shares its rendezvous store with the workers; after a restart the new workers could
    # read the dead rank's address from it (2 of 5 restarts failed): a store per round restarts cleanly
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    env.setdefault(LEVEL_VARIABLE, "INFO")  # the ranks print their rank-0 lines (read by initialize)
    if args.as_deepspeed:
        env["ZEROSHARD_AS_DEEPSPEED"] = "1"
    return env


def _job(args: argparse.Namespace, master_addr: str, nodes: int) -> Job:
    return Job(
        script=args.script,
        script_args=tuple(args.script_args),
        master_addr=master_addr,
        master_port=args.master_port or DEFAULT_MASTER_PORT,
        nnodes=args.nnodes or str(nodes),
        max_restarts=args.max_restarts,
        module=args.module,
        as_deepspeed=args.as_deepspeed,
        master_timeout=args.master_timeout,
        rdzv_conf=args.rdzv_conf,
    )


def run_node(args: argparse.Namespace) -> int:
    """This node's agent in a multi-node job (``--no_ssh --node_rank K``): wait for the master, then join."""
    if args.node_rank is None:
        raise SystemExit("zeroshard: --no_ssh starts one node of a job: give its --node_rank (0 is the master)")
    if args.hostfile is not None:
        raise SystemExit("zeroshard: --no_ssh runs this node only; drop --hostfile (or drop --no_ssh)")
    nprocs = _local_processes(args)
    job = _job(args, args.master_addr or "127.0.0.1", args.num_nodes or 1)
    most = _most_nodes(job.nnodes)
    if args.node_rank >= most:
        raise SystemExit(
            f"zeroshard: --node_rank {args.node_rank} but the job has at most {most} node(s) (--nnodes {job.nnodes}); "
            "node ranks are 0 .. nodes-1"
        )
    if args.node_rank > 0:
        wait_for_master(job.master_addr, job.master_port, job.master_timeout, args.node_rank)
    rdzv_id = os.environ.get("ZEROSHARD_JOB_ID", f"zeroshard-{job.master_port}")
    return run_processes([agent_command(job, args.node_rank, nprocs, rdzv_id)], _agent_env(args))


def _most_nodes(nnodes: str) -> int:
    """The largest node count torchrun's ``--nnodes`` allows: ``N`` or ``MIN:MAX``."""
    low, _, high = nnodes.partition(":")
    try:
        counts = [int(low), int(high or low)]
    except ValueError:
        raise SystemExit(f"zeroshard: --nnodes {nnodes!r}: expected N or MIN:MAX") from None
    if not 1 <= counts[0] <= counts[1]:
        raise SystemExit(f"zeroshard: --nnodes {nnodes!r}: expected 1 <= MIN <= MAX")
    return counts[1]


def run_hostfile(args: argparse.Namespace, export_prefixes: tuple[str, ...] = ()) -> int:
    """Start every node of the hostfile (after ``--include/--exclude/--num_nodes/--num_gpus``) through the
    chosen launcher; each runs ``zeroshard --no_ssh --node_rank K``."""
    try:
        with open(args.hostfile) as f:
            hosts = parse_hostfile(f.read(), args.hostfile)
        nodes = select_resources(hosts, args.include, args.exclude, args.num_nodes, args.num_gpus)
    except OSError as err:
        raise SystemExit(f"zeroshard: cannot read --hostfile {args.hostfile}: {err.strerror or err}") from None
    except ValueError as err:
        raise SystemExit(f"zeroshard: {err}") from None
    tool = {"ssh": "ssh", "pdsh": "pdsh", "slurm": "srun", "openmpi": "mpirun"}[args.launcher]
    if shutil.which(tool) is None:
        raise SystemExit(f"zeroshard: --launcher {args.launcher} needs '{tool}' on PATH, and it is not there")
    job = _job(args, args.master_addr or next(iter(nodes)), len(nodes))
    env, skipped = exported_environment(
        dict(os.environ), read_env_files([os.path.expanduser("~"), os.getcwd()]), export_prefixes
    )
    if skipped:
        print(
            f"zeroshard: warning: not exporting {skipped} to the nodes: not shell variable names "
            "([A-Za-z_][A-Za-z0-9_]*)",
            file=sys.stderr,
        )
    if args.as_deepspeed:
        env["ZEROSHARD_AS_DEEPSPEED"] = "1"
    build = LAUNCHERS[args.launcher]
    extra = {"ssh_port": args.ssh_port} if args.launcher == "ssh" else {}
    try:
        commands = build(job, nodes, env, os.getcwd(), **extra)
    except ValueError as err:
        raise SystemExit(f"zeroshard: {err}") from None
    print(f"zeroshard: {len(nodes)} node(s) via {args.launcher}: " + ", ".join(f"{h} {s}" for h, s in nodes.items()))
    return run_processes(commands, dict(os.environ))


def run_processes(commands: list[list[str]], env: dict[str, str]) -> int:
    """Run the agents (one, or one starter per node) until all end or one fails, which stops the others. SIGTERM
    or SIGINT sent to this launcher is passed on (an agent stops every rank; an orphan would keep training); the
    exit code is then 128 + the signal's number, as a shell reports a process ended by that signal."""
    processes = [subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent) for cmd in commands]
    received: list[int] = []

    def forward(signum, frame):
        received.append(signum)
        for process in processes:
            if process.poll() is None:
                process.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = _wait_all(processes)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received:
        return 128 + received[0]
    return code if code >= 0 else 128 - code


def _die_with_parent() -> None:
    """In each child before it runs: ask Linux to send it SIGTERM when this launcher dies, even by SIGKILL (which
    no handler sees), so the agent stops its ranks instead of training on as orphans. Elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() == 1:  # the launcher died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _wait_all(processes: list[subprocess.Popen]) -> int:
    """0 when every process succeeds; else the first failure's code, after stopping the rest."""
    if len(processes) == 1:
        return processes[0].wait()
    while True:
        codes = [p.poll() for p in processes]
        failed = next((c for c in codes if c not in (None, 0)), None)
        if failed is not None:
            for process in processes:
                if process.poll() is None:
                    process.terminate()
            for process in processes:
                process.wait()
            return failed
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main())
