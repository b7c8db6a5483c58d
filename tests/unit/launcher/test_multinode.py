import shlex
import subprocess
import sys

import pytest

from zeroshard.launcher.multinode import (
    Job,
    agent_command,
    exported_environment,
    openmpi_command,
    parse_env_text,
    parse_rdzv_conf,
    pdsh_command,
    read_env_files,
    slurm_command,
    ssh_commands,
)

JOB = Job("train.py", ("--deepspeed_config", "ds.json"), "10.0.0.1", 29500, "2", max_restarts=1)
NODES = {"worker-0": [0, 1], "worker-1": [0, 1]}


def test_ssh_runs_this_launcher_on_every_node_with_its_rank():
    commands = ssh_commands(JOB, NODES, {"NCCL_DEBUG": "INFO"}, "/work dir", ssh_port=2222)
    assert [c[:4] for c in commands] == [["ssh", "-p", "2222", "worker-0"], ["ssh", "-p", "2222", "worker-1"]]
    remote = shlex.split(commands[1][4])
    assert remote[:2] == ["cd", "/work dir"] and "NCCL_DEBUG=INFO;" in remote and "CUDA_VISIBLE_DEVICES=0,1;" in remote
    launched = remote[remote.index("exec") + 1 :]
    assert launched[:3] == [sys.executable, "-m", "zeroshard.launcher.cli"]
    flags = " ".join(launched)
    assert "--no_ssh --node_rank 1 --nnodes 2 --num_gpus 2 --master_addr 10.0.0.1 --master_port 29500" in flags
    assert "--max_restarts 1" in flags and launched[-3:] == ["train.py", "--deepspeed_config", "ds.json"]


def test_pdsh_slurm_and_openmpi_tell_each_node_its_rank_their_way():
    pdsh = pdsh_command(JOB, NODES, {}, "/w")[0]
    assert pdsh[:6] == ["pdsh", "-S", "-f", "1024", "-w", "worker-0,worker-1"] and "--node_rank %n" in pdsh[6]
    srun = slurm_command(JOB, NODES, {}, "/w")[0]
    assert srun[:4] == ["srun", "--nodes=2", "--ntasks-per-node=1", "--nodelist=worker-0,worker-1"]
    assert "--node_rank $SLURM_NODEID" in srun[-1]
    mpi = openmpi_command(JOB, NODES, {}, "/w")[0]
    assert mpi[:5] == ["mpirun", "-n", "2", "--host", "worker-0:1,worker-1:1"]
    assert "--node_rank $OMPI_COMM_WORLD_RANK" in mpi[-1]
    with pytest.raises(ValueError, match="nodes use different slots .* use --launcher ssh"):
        pdsh_command(JOB, {"worker-0": [0, 1], "worker-1": [0]}, {}, "/w")


def test_agent_joins_a_c10d_rendezvous_at_the_master():
    cmd = agent_command(Job("t.py", (), "10.0.0.1", 29500, "1:2", max_restarts=3), 1, 4, "job")
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--nnodes=1:2" in cmd and "--nproc_per_node=4" in cmd and "--max_restarts=3" in cmd
    assert "--rdzv_backend=c10d" in cmd and "--rdzv_endpoint=10.0.0.1:29500" in cmd
    assert "--rdzv_conf=is_host=false" in cmd and cmd[-1] == "t.py"
    assert "--rdzv_conf=is_host=true" in agent_command(JOB, 0, 2, "job")


def test_rendezvous_options_reach_every_nodes_agent():
    """``--rdzv_conf last_call_timeout=5,join_timeout=60``: each node's agent gets them after the launcher's own
    ``is_host``, and a node started by ssh passes them on to its launcher."""
    job = Job("t.py", (), "10.0.0.1", 29500, "1:2", rdzv_conf=parse_rdzv_conf("last_call_timeout=5, join_timeout=60"))
    assert "--rdzv_conf=is_host=false,last_call_timeout=5,join_timeout=60" in agent_command(job, 1, 1, "job")
    remote = shlex.split(ssh_commands(job, NODES, {}, "/w", None)[1][2])
    assert remote[remote.index("--rdzv_conf") + 1] == "last_call_timeout=5,join_timeout=60"
    assert "--rdzv_conf" not in shlex.split(ssh_commands(JOB, NODES, {}, "/w", None)[0][2])


@pytest.mark.parametrize(
    "text, message",
    [
        ("last_call_timeout", "is not KEY=VALUE"),
        ("is_host=true", "unknown option 'is_host'"),
        ("last_call_timeout=5;touch /tmp/x", "is not a whole number"),
        ("last_call_timeout=$(reboot)", "is not a whole number"),
        ("last_call_timeout=nan", "is not a whole number"),
        ("last_call_timeout=-1", "is not a whole number"),
        ("last_call_timeout=0", "is not a whole number"),
        ("last_call_timeout=1e9", "is not a whole number"),
        ("last_call_timeout=99999999999999999999", "is not a whole number"),
        ("last_call_timeout=\u0665", "is not a whole number"),
        ("last_call_timeout=٥", "is not a whole number"),
        ("last_call_timeout=5,last_call_timeout=6", "given twice"),
        ("timeout=5", "unknown option"),
    ],
)
def test_hostile_rendezvous_options_are_named_errors(text, message):
    with pytest.raises(ValueError, match=message):
        parse_rdzv_conf(text)


def test_environment_files_and_exported_variables(tmp_path):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir(), cwd.mkdir()
    (home / ".deepspeed_env").write_text("NCCL_IB_DISABLE=1\nSHARED=home\n")
    (cwd / ".zeroshard_env").write_text("# comment\nexport SHARED='cwd'\n\nDATA=/data\n")
    files = read_env_files([str(home), str(cwd)])
    assert files == {"NCCL_IB_DISABLE": "1", "SHARED": "cwd", "DATA": "/data"}
    env, skipped = exported_environment({"NCCL_DEBUG": "INFO", "HOME": "/root", "PYTHONPATH": "/src"}, files)
    assert env == {"NCCL_DEBUG": "INFO", "PYTHONPATH": "/src", **files} and skipped == []
    with pytest.raises(ValueError, match=r"\.zeroshard_env:1: 'not a pair' is not KEY=VALUE"):
        parse_env_text("not a pair", ".zeroshard_env")


# -- hostile input: nothing a variable name, value, host or directory holds runs as shell code --------------------
def _run_line(line: str, cwd) -> subprocess.CompletedProcess:
    """Run a remote line the way ssh's remote shell does, with the launcher replaced by a harmless command."""
    line = line.replace(shlex.join([sys.executable, "-m", "zeroshard.launcher.cli"]), "echo", 1)
    return subprocess.run(["sh", "-c", line], cwd=cwd, capture_output=True, text=True, timeout=60)


def test_variable_names_that_are_shell_code_are_skipped_and_named(tmp_path):
    evil = "NCCL_X;touch${IFS}" + str(tmp_path / "PWNED") + ";Y"
    env, skipped = exported_environment({evil: "1", "NCCL_OK": "a b;touch x", "TORCH_\u00e9": "1"}, {})
    assert skipped == sorted([evil, "TORCH_\u00e9"]) and env == {"NCCL_OK": "a b;touch x"}
    out = _run_line(ssh_commands(JOB, NODES, env, str(tmp_path), None)[0][-1], tmp_path)
    assert out.returncode == 0 and not (tmp_path / "PWNED").exists() and not (tmp_path / "x").exists(), out
    with pytest.raises(ValueError, match="not shell variable names"):
        ssh_commands(JOB, NODES, {evil: "1"}, str(tmp_path), None)
    with pytest.raises(ValueError, match="is not KEY=VALUE"):
        parse_env_text("A;touch${IFS}F=1", ".deepspeed_env")


def test_values_and_directories_with_metacharacters_stay_data(tmp_path):
    odd = tmp_path / "dir $(touch PWNED); `id`"
    odd.mkdir()
    env = {"NCCL_SOCKET_IFNAME": "$(touch PWNED2)"}
    out = _run_line(ssh_commands(JOB, NODES, env, str(odd), None)[0][-1], tmp_path)
    assert out.returncode == 0, out.stderr
    assert not list(tmp_path.rglob("PWNED*")), out.stdout


def test_a_missing_working_directory_fails_the_node_naming_host_and_directory(tmp_path):
    """Before, `cd DIR && export A; export B; exec CMD` ran the job from the login directory when cd failed."""
    missing = str(tmp_path / "gone")
    for line in (
        ssh_commands(JOB, NODES, {"NCCL_DEBUG": "INFO"}, missing, None)[0][-1],
        pdsh_command(JOB, NODES, {}, missing)[0][-1],
        slurm_command(JOB, NODES, {}, missing)[0][-1],
    ):
        out = _run_line(line, tmp_path)
        assert out.returncode == 1 and out.stdout == "", out
        assert f"cannot enter the working directory {missing}" in out.stderr and "zeroshard: node " in out.stderr
