"""Multi-node commands: what each node runs, and how it is started there (ssh, pdsh, SLURM, Open MPI).

Every node runs this launcher again with ``--no_ssh --node_rank K`` (the same path a cluster that starts one
launcher per node uses), which waits for the master and starts torchrun's elastic agent with a c10d
rendezvous at ``--master_addr:--master_port``. Building the commands is pure; ``run_nodes`` starts them.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import sys
import time
from dataclasses import dataclass
from typing import Optional

from .hostfile import Resources

ENV_FILES = (".zeroshard_env", ".deepspeed_env")
# the launching environment's variables every node gets (besides the env files' and per-node settings)
_EXPORTED_PREFIXES = ("NCCL_", "GLOO_", "PYTHON", "ZEROSHARD_", "TORCH_", "OMP_", "MKL_", "UCX_", "FI_", "HF_")
_NODE_RANK = "\0NODE_RANK\0"  # replaced by each launcher's own way of telling a node its rank
# a name the remote shell reads as one variable name; anything else would be shell code in the exported line
_VARIABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class Job:
    """What every node runs: the script, and the launcher options each node's agent needs."""

    script: str
    script_args: tuple[str, ...]
    master_addr: str
    master_port: int
    nnodes: str  # torchrun's --nnodes: "N" or "MIN:MAX" (elastic membership)
    max_restarts: int = 0
    module: bool = False
    as_deepspeed: bool = False
    master_timeout: float = 300.0
    rdzv_conf: tuple[tuple[str, int], ...] = ()  # the c10d rendezvous's timeouts (--rdzv_conf), seconds


# torchrun's c10d rendezvous options a user may set (whole seconds, or counts), as its --rdzv_conf takes them;
# ``is_host`` is the launcher's own (node 0 hosts the rendezvous store)
RDZV_OPTIONS = (
    "join_timeout",
    "last_call_timeout",
    "close_timeout",
    "heartbeat_timeout",
    "keep_alive_interval",
    "keep_alive_max_attempt",
    "read_timeout",
)


def parse_rdzv_conf(text: str) -> tuple[tuple[str, int], ...]:
    """``--rdzv_conf KEY=VALUE,...`` (torchrun's flag): the c10d rendezvous's timeouts, e.g.
    ``last_call_timeout=5`` (how long a rendezvous that has its minimum of nodes waits for more: after a node
    leaves an elastic job, the survivors wait this long before going on). Keys are :data:`RDZV_OPTIONS`, values
    whole numbers from 1 to 86400; anything else is a ``ValueError`` naming it."""
    options: dict[str, int] = {}
    for item in text.split(","):
        key, sep, value = item.strip().partition("=")
        if not sep:
            raise ValueError(f"--rdzv_conf: {item.strip()!r} is not KEY=VALUE")
        if key not in RDZV_OPTIONS:
            raise ValueError(f"--rdzv_conf: unknown option {key[:40]!r}; known: {', '.join(RDZV_OPTIONS)}")
        if key in options:
            raise ValueError(f"--rdzv_conf: {key} given twice")
        if not value.isascii() or not value.isdigit() or not 1 <= int(value) <= 86400:
            raise ValueError(f"--rdzv_conf: {key}={value[:40]!r} is not a whole number from 1 to 86400")
        options[key] = int(value)
    return tuple(options.items())


def parse_env_text(text: str, source: str) -> dict[str, str]:
    """``KEY=VALUE`` lines (``#`` comments, blank lines, an optional ``export`` prefix)."""
    values = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.removeprefix("export ").partition("=")
        if not sep or not _VARIABLE.fullmatch(key.strip()):
            raise ValueError(f"{source}:{number}: '{line}' is not KEY=VALUE")
        values[key.strip()] = value.strip().strip("'\"")
    return values


def read_env_files(directories: list[str]) -> dict[str, str]:
    """The variables of ``.zeroshard_env`` and DeepSpeed's ``.deepspeed_env`` in each directory (later win)."""
    values: dict[str, str] = {}
    for directory in directories:
        for name in ENV_FILES:
            path = os.path.join(directory, name)
            if os.path.isfile(path):
                with open(path) as f:
                    values.update(parse_env_text(f.read(), path))
    return values


def exported_environment(
    environ: dict[str, str], from_files: dict[str, str], extra_prefixes: tuple[str, ...] = ()
) -> tuple[dict[str, str], list[str]]:
    """The variables every node gets: the launching environment's by prefix (zeroshard's and ``extra_prefixes``,
    DeepSpeed's ``EXPORT_ENVS`` as a client extends it), then the env files'. Returns them and the names skipped
    because a shell would not read them as a variable name (``NCCL_X;touch${IFS}F``: the environment can hold any
    name, and the remote line is shell code)."""
    exported = {k: v for k, v in environ.items() if k.startswith((*_EXPORTED_PREFIXES, *extra_prefixes))}
    merged = {**exported, **from_files}
    skipped = sorted(k for k in merged if not _VARIABLE.fullmatch(k))
    return {k: v for k, v in merged.items() if k not in skipped}, skipped


def node_command(job: Job, node_rank: str, nproc: int) -> list[str]:
    """The launcher invocation one node runs (``node_rank`` may be a placeholder)."""
    cmd = [sys.executable, "-m", "zeroshard.launcher.cli", "--no_ssh", "--node_rank", node_rank]
    cmd += ["--nnodes", job.nnodes, "--num_gpus", str(nproc), "--master_addr", job.master_addr]
    cmd += ["--master_port", str(job.master_port), "--max_restarts", str(job.max_restarts)]
    cmd += ["--master_timeout", str(job.master_timeout)]
    if job.rdzv_conf:
        cmd += ["--rdzv_conf", ",".join(f"{k}={v}" for k, v in job.rdzv_conf)]
    cmd += ["--module"] * job.module + ["--as_deepspeed"] * job.as_deepspeed
    return cmd + [job.script, *job.script_args]


def remote_shell(job: Job, node_rank: str, slots: list[int], env: dict[str, str], cwd: str) -> str:
    """One shell line: enter the working directory (or fail the node, naming host and directory: the job must not
    run from the login directory), export the environment (and the node's devices), run. Every name is checked
    and every value and path quoted; ``node_rank`` is the launcher's own placeholder (``%n``, ``$SLURM_NODEID``)."""
    bad = sorted(k for k in env if not _VARIABLE.fullmatch(k))
    if bad:
        raise ValueError(f"environment variable names {bad} are not shell variable names; they cannot be exported")
    exports = {**env, "CUDA_VISIBLE_DEVICES": ",".join(map(str, slots))}
    line = " ".join(f"export {k}={shlex.quote(v)};" for k, v in sorted(exports.items()))
    command = shlex.join(node_command(job, _NODE_RANK, len(slots)))
    directory = shlex.quote(cwd)
    failure = shlex.quote(f"zeroshard: node %s cannot enter the working directory {cwd}; the job does not start\n")
    enter = f'cd {directory} || {{ printf {failure} "$(hostname)" >&2; exit 1; }};'
    return f"{enter} {line} exec {command}".replace(shlex.quote(_NODE_RANK), node_rank)


def ssh_commands(job: Job, nodes: Resources, env: dict[str, str], cwd: str, ssh_port: Optional[int]) -> list[list[str]]:
    """One ``ssh`` per node."""
    port = ["-p", str(ssh_port)] if ssh_port is not None else []
    return [
        ["ssh", *port, host, remote_shell(job, str(rank), slots, env, cwd)]
        for rank, (host, slots) in enumerate(nodes.items())
    ]


def _uniform(nodes: Resources, launcher: str) -> list[int]:
    layouts = {tuple(slots) for slots in nodes.values()}
    if len(layouts) > 1:
        raise ValueError(
            f"--launcher {launcher} starts one command on every node, but the nodes use different slots "
            f"({'; '.join(f'{h}: {s}' for h, s in nodes.items())}); use --launcher ssh"
        )
    return list(layouts.pop())


def pdsh_command(job: Job, nodes: Resources, env: dict[str, str], cwd: str) -> list[list[str]]:
    """One ``pdsh`` fanning out to every node; pdsh substitutes ``%n`` with the node's rank."""
    slots = _uniform(nodes, "pdsh")
    return [["pdsh", "-S", "-f", "1024", "-w", ",".join(nodes), remote_shell(job, "%n", slots, env, cwd)]]


def slurm_command(job: Job, nodes: Resources, env: dict[str, str], cwd: str) -> list[list[str]]:
    """One ``srun`` task per node; SLURM tells each its rank in ``SLURM_NODEID``."""
    slots = _uniform(nodes, "slurm")
    line = remote_shell(job, "$SLURM_NODEID", slots, env, cwd)
    return [
        ["srun", f"--nodes={len(nodes)}", "--ntasks-per-node=1", f"--nodelist={','.join(nodes)}", "bash", "-c", line]
    ]


def openmpi_command(job: Job, nodes: Resources, env: dict[str, str], cwd: str) -> list[list[str]]:
    """One ``mpirun`` process per node; Open MPI tells each its rank in ``OMPI_COMM_WORLD_RANK``."""
    slots = _uniform(nodes, "openmpi")
    line = remote_shell(job, "$OMPI_COMM_WORLD_RANK", slots, env, cwd)
    hosts = ",".join(f"{host}:1" for host in nodes)
    return [["mpirun", "-n", str(len(nodes)), "--host", hosts, "--map-by", "ppr:1:node", "bash", "-c", line]]


LAUNCHERS = {"ssh": ssh_commands, "pdsh": pdsh_command, "slurm": slurm_command, "openmpi": openmpi_command}


def agent_command(job: Job, node_rank: int, nproc: int, rdzv_id: str) -> list[str]:
    """torchrun's elastic agent for one node, joining the c10d rendezvous at the master."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={job.nnodes}", f"--nproc_per_node={nproc}"]
    cmd += [f"--max_restarts={job.max_restarts}", "--rdzv_backend=c10d", f"--rdzv_id={rdzv_id}"]
    cmd += [f"--rdzv_endpoint={job.master_addr}:{job.master_port}"]
    options = [("is_host", "true" if node_rank == 0 else "false"), *job.rdzv_conf]
    cmd += ["--rdzv_conf=" + ",".join(f"{key}={value}" for key, value in options)]
    if job.as_deepspeed:  # every rank starts in the runner, which installs the alias before the script runs
        return cmd + ["--module", "zeroshard.compat.run", *(["-m"] if job.module else []), job.script, *job.script_args]
    return cmd + ["--module"] * job.module + [job.script, *job.script_args]


def wait_for_master(addr: str, port: int, timeout_s: float, node_rank: int) -> None:
    """A node other than the master waits (bounded) until the master's rendezvous port accepts connections."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((addr, port), timeout=min(2.0, max(timeout_s, 0.1))):
                return
        except OSError as err:
            if time.monotonic() >= deadline:
                raise SystemExit(
                    f"zeroshard: node {node_rank} cannot reach the master at {addr}:{port} after {timeout_s:g} s "
                    f"({err.strerror or err}); check that node 0 is started, --master_addr/--master_port are "
                    "right and the port is open between the nodes"
                ) from None
            time.sleep(0.5)
